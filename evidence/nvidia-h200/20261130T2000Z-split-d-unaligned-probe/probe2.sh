run() { CUDA_LAUNCH_BLOCKING=1 timeout 90 python3 .scratch/probe2.py "$@" 2>&1 | grep -E "maxerr|Error" | tail -1; }
run 80 0 0 0                        # control: whole pieces
FUSEDATTN_SPLIT_D=0 run 72 0 0 0    # control: padded
run 72 0 0 0                        # overlap, stride 72
run 72 0 8 0                        # overlap, stride 80 (aligned rows)
run 72 0 0 1                        # overlap, one stage
FUSEDATTN_ONE_LOOP=1 run 72 0 0 0   # one key loop
FUSEDATTN_ONE_LOOP=0 run 72 0 0 0   # three key loops
run 72 1 0 0                        # causal
run 72 1 8 0                        # causal, aligned rows
run 80 0 8 0                        # whole pieces, stride 88 (unaligned rows)
run 176 0 0 0                       # overlap 16, stride 176 (aligned)
FUSEDATTN_SPLIT_D=3 run 200 0 0 0   # three, overlap
FUSEDATTN_SPLIT_D=3 run 200 0 8 0   # three, overlap, stride 208
DUMP=1 run 72 0 0 0
DUMP=1 run 72 0 8 0
