run() { CUDA_LAUNCH_BLOCKING=1 timeout 90 python3 .scratch/probe2.py "$@" 2>&1 | grep -E "maxerr|Error" | tail -1; }
run 8 0 0 0            # padded to 16, stride 8
run 8 0 0 0 float16
run 12 0 0 0           # padded to 16, stride 12
run 16 0 8 0           # whole 16, stride 24
run 16 0 0 0           # whole 16, stride 16 (control)
run 24 0 0 0           # padded to 32, stride 24
run 32 0 8 0           # whole 32, stride 40
run 40 0 0 0           # padded to 64, stride 40
run 64 0 8 0           # whole 64, stride 72
run 96 0 8 0           # 64 + 32, stride 104
run 80 0 8 0 float16   # 64 + 16, stride 88, fp16
run 128 0 8 0          # whole 128, stride 136
