for args in "72 0 bfloat16 2 16 4096" "80 0 bfloat16 2 16 4096" "96 0 bfloat16 2 16 4096" "80 1 bfloat16 2 16 4096" "80 0 bfloat16 1 2 256" "80 0 float16 1 2 1000" "144 0 bfloat16 2 16 4096" "72 0 bfloat16 1 2 256"; do
  for sd in 0 1; do FUSEDATTN_SPLIT_D=$sd CUDA_LAUNCH_BLOCKING=1 timeout 60 python3 .scratch/probe.py $args 2>&1 | grep -E "maxerr|Error" | tail -1; done
done
