#!/usr/bin/env bash
# One measurement round on the H200 (the device tool's machine), each step's output under
# /tmp/ev (the evidence folders), packed into $OUT/ev.tgz after every step and every 20 s
# while one runs, so that a run cut short still brings back what it finished and how far
# the step it was in had got (the device tool does not bring back
# folders that deep one by one). Steps, in the order given:
#   fa4 K       copy FA4's staged part K (.peers/K, carried) into /tmp/fa4; the last part
#               (the one with install.sh) also installs it (../shared/peers/stage-fa4.sh).
#               The tracked tree (33 MB on 2026-12-03, 26 of them evidence/, since the
#               tier's logs are gzipped; 50 MB before) and one 21 MB part fit a call's
#               64 MiB, two parts do not: move evidence/ out of the tree for those calls
#               (nothing runs from it, the tests included) and carry two parts a call,
#               `fa4 1 fa4 2`, then `fa4 3 fa4 4 bench prefill` on the same warm machine;
#               put it back after, and say in the evidence that the call left it behind.
#               The tier carries the numpy wheel (.whl, 16.6 MB) beside the tree; since
#               2026-12-07 (evidence/ at 41 MB of a 48 MB tree) the two are over the 64 MiB
#               a call carries: move evidence/ out for such a call too, and say so
#   tier        the GPU tier: scripts/gpu_tier.py (the whole suite, both paths)
#   apply P     notes/patches/P.patch onto this copy of the tree (`revert P` takes it off);
#               later steps' evidence is marked dirty (FUSEDATTN_GIT_DIRTY=1) and the log
#               names the patch and its hash. Kernel patches change Triton's cache key: the
#               prebuilt entries then miss and kernels compile on first use
#   hopper      tests/test_hopper.py, tests/test_plans.py and tests/test_fp8.py alone, no
#               evidence folder
#   hopperbwd   tests/test_hopper_backward.py alone (-x), no evidence folder
#   bwd         scripts/hopper_bwd_check.py: the backward's rows $ROWS (default all),
#               providers $ONLY (default all: the Hopper backward, its A/Bs, portable,
#               cuDNN, FA4); under $ev/bwd-TIME/ (so a round may take several)
#   losscurves  scripts/hf_loss_curves.py: 100 training steps of a small Mistral, fusedattn
#               (the Hopper path) against sdpa and eager, and the plot
#   switchab N V  scripts/switch_ab.py: `hopper.forward`'s switch N at values V (Python
#               literals, comma-separated, the first the reference) in turn in one process,
#               rows $ABROWS (default all: dense, window, varlen), verified, bits compared;
#               ABENTRIES=1: each value is entries laid over the table (switch_ab --entries);
#               ABSET=NAME=LITERAL: another switch held at that value (switch_ab --set);
#               under $ev/switchab-TIME/ (two in one round, both orders, keep both JSONs)
#   windowab W S  scripts/window_sinks_ab.py: windows W (keys, comma-separated) at shapes S
#               ("dim,heads,heads_kv" joined by ';'), into $ev/window-paths/
#   check       scripts/hopper_check.py --sweep (ping-pong A/B, the short-length sweep)
#   sweep       scripts/hopper_check.py --sweep-only
#   varlensweep scripts/hopper_check.py --varlen-sweep (varlen causal, Hopper against
#               portable by longest document: varlen's threshold)
#   rows        scripts/hopper_check.py's rows alone, providers $ONLY (default: the Hopper
#               path, with SHARED_KV, cuDNN, FA4), rows $ROWIDX (indices, default all);
#               under $ev/rows-TIME/
#   bench S     fusedattn bench --suite S with the Hopper-era providers (FA4 where staged;
#               $PROVIDERS, comma-separated, to choose), the problems matching $MATCH if set
#   ncu ROW     Nsight Compute of our forward against FA4's on a prefill row, ROW as
#               "dim,batch,heads,seq[,causal|varlen]" (scripts/ncu_vs_cudnn.py --peer fa4;
#               varlen: the varlen suite's batch at heads and dim)
#   ncubwd ROW  Nsight Compute of our backward's kernels against cuDNN's on ROW
#               "dim,batch,heads,seq[,causal|varlen]" (scripts/ncu_vs_cudnn.py --bwd-only;
#               the kernels told apart by name), the Hopper backward forced; varlen: the
#               varlen suite's batch at heads and dim against FA4's (where staged)
#   ncusrc ROW  Nsight Compute's source view of our forward alone on ROW (as ncu's), with
#               $KNOB (NAME=VALUE, `hopper.forward`'s A/B switch) and $DTYPE (e.g. fp8:
#               the FP8 forward, V's transpose in the range too) if set: warp stalls
#               sampled per SASS instruction, as CSV (ncusrc-*-sass.csv) and the report
#   ncuorder ROW  Nsight Compute of the Hopper backward kernel alone under each dQ adds'
#               order forced ("down", "up"), ROW "dim,batch,heads,heads_kv,seq[,causal]":
#               L2 hit rate and DRAM bytes (does "up" lose L2 reuse under GQA?) and the
#               SMs' active cycles against elapsed (or a tail?), one CSV per order;
#               $ORDERS (default "down up") may name "across" and "heads" too: "down"
#               with `DOWN_ACROSS_HEADS` on and off (does a wave's revisit of GQA's query
#               tiles miss L2?)
#   ncusrcbwd ROW  the same source view of the Hopper backward kernel alone (forced), ROW
#               "dim,batch,heads,seq[,causal]", $KNOB as backward.NAME=VALUE if set
#   ncufp8 ROW  Nsight Compute of the FP8 forward (V's transpose and the Hopper kernel)
#               against cuDNN in bf16 on the same values, ROW "dim,batch,heads,seq[,causal]"
#   ncudecode K D  Nsight Compute of one decode call's split kernel (scripts/decode_ncu.py:
#               B32 H32/8, 8192 keys), K fp8 or bf16, head dim D, into $ev/ncu/decode-K-dD.csv
#   decodetiles D  scripts/decode_tiles.py: decode's kernels and tiles, e4m3 (tiles.fp8_decode
#               and _flash_fwd) and bf16, head dims D
#               (comma-separated), into $ev/decode-tiles-TIME/
#   splitsab    scripts/decode_splits_ab.py: decode's split counts (the rule's, 1, 2, twice
#               the rule's, $SPLITCOUNTS) by GPU µs (graph) and host µs a call, rows $SPLITROWS
#               (decode_splits_ab.py --rows), into $ev/decode-splits-TIME/
#   fp8check    scripts/hopper_fp8_check.py: the FP8 rows with tile candidates, the A/B
#               switches, V's transpose alone, portable, cuDNN bf16 (providers $ONLY, default
#               all); --sweep of short lengths; under $ev/fp8check-TIME/
#   hostrows    scripts/host_profile.py --bench-rows: the host suite's fusedattn calls,
#               each timed alone and profiled (cProfile's top functions)
#   mergeab D   scripts/merge_ab.py: split-KV's merge of D/src (an older tree's) against this
#               tree's, in one process, on decode rows' partials, into $ev/mergeab/
#   hostab D    scripts/host_ab.py: host µs a call of D/src's library (an older commit's,
#               renamed `fusedattn_base`) against this tree's and SDPA's in one process,
#               their loops taking turns (D: an ignored folder the device tool carries)
#   coldstart   fusedattn bench --suite coldstart; PYC=1 first gives every module bytecode
#               (`bytecode` below: pip compiles it at install, but this host's site-packages
#               and the copied tree have none, so each fresh process compiled the sources it
#               imported, sympy alone 2.9 s, evidence 0245Z)
#   coldrow I   one coldstart problem (`coldstart.problems()[I]`) in a fresh process with an
#               empty Triton cache (or as $COLDMODE starts it: "after warmup", "after a
#               primer"), $ROUNDS times (default 3), a JSON line each into
#               $ev/coldrow-I.jsonl: an A/B of a first call without the whole suite (PYC=1
#               as for coldstart)
#   coldab D I  coldrow I alternating an older tree's src/ (D/src) with this one: old, new,
#               new, old, $ROUNDS (default 2) fresh processes each, into $ev/coldab-I.jsonl
#               ($COLDMODE as for coldrow; each side's warmup then runs with its own src)
#   coldenv I V  coldrow I with the environment's V (VAR=VALUE, e.g. FUSEDATTN_PREBUILT=0)
#               set, then unset twice, then set ($ROUNDS each), into $ev/coldenv-I.jsonl
#   prebuild    scripts/prebuild.py: the package's prebuilt kernels made anew into
#               src/fusedattn/prebuilt (used by the steps after it) and $ev/prebuilt.tgz
#   firstcall   scripts/first_call_profile.py: cProfile of a fresh process's first call
#               after warmup (nothing compiles; where its time goes), or as $MODE starts
#               it (e.g. "empty cache"); $PROBLEMS (default 3,0); PYC=1 as for coldstart
#   hangrepro   scripts/hang_repro.py: the Hopper backward calls that stuck in two tiers
#               (073459Z, 085707Z), repeated beside GPU load for $HANGSECONDS (default
#               300), deterministic and racing; a hang's stacks into $ev/hang_repro.json
#               ($HANGTAG after its name; $HANGARGS more arguments, e.g. --switch ORDER='down')
#   hangvar S   hangrepro with hopper.backward switches S ("NAME=VALUE,...", "-" for none) into
#               $ev/hang_repro-S.json: several in one call bisect the hang's wait
#   train       scripts/host_profile.py --train: a training step's host cost (fwd+bwd, ours
#               and SDPA's) by thread and op under torch.profiler, the backward's Python
#               under cProfile in autograd's thread
#   directab    scripts/host_profile.py --direct-ab: launch.DIRECT_LAUNCH on and off in one
#               process (forward, fwd+bwd; auto and the Hopper path), beside SDPA cuDNN
#   pyk F K     the tests of file F matching pytest's -k expression K
#   hostprof    scripts/host_profile.py --sweep: host time a call by layer, SDPA's, the
#               layers one by one, and the kernels a sweep of lengths compiles
#   cp L        (a multi-GPU kind) scripts/context_parallel_bench.py on every GPU of the
#               machine, layouts L (e.g. ring,ulysses,usp2), S 128k and 256k (issue 35)
# Usage (the device tool, from the repo root):
#   bash scripts/h200_round.sh fa4 4 tier bench prefill ncu 64,4,32,4096
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl 2>/dev/null || true   # the lab's numpy 2.4.6 (numba-cuda)
export PYTHONPATH=/tmp/site:$PWD/src:/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages
export FUSEDATTN_GIT_COMMIT=${FUSEDATTN_GIT_COMMIT:-unknown} FUSEDATTN_GIT_DIRTY=${FUSEDATTN_GIT_DIRTY:-1}
export PYTHONUNBUFFERED=1 COLUMNS=200
ev=/tmp/ev
mkdir -p "$ev"
log=$ev/round-$(date -u +%H%M%S).log
rc=0
# the evidence so far into $OUT/ev.tgz: packed beside it (as .ev.tgz.$1, one name a
# packer) and renamed into place, so that the copy brought back is whole wherever the call
# is cut; every 20 s by the packer below, after every step, and once at the end
pack() { tar czf "$OUT/.ev.tgz.$1" -C /tmp ev 2>/dev/null && mv -f "$OUT/.ev.tgz.$1" "$OUT/ev.tgz"; }
if [ -n "${OUT:-}" ]; then
  (while sleep 20; do pack part; done) &
  packer=$!
  trap 'kill $packer 2>/dev/null' EXIT
fi
# PYC=1 (coldstart, coldrow): every module the first calls import gets bytecode first, as
# an installed environment has it, through a writable PYTHONPYCACHEPREFIX: the tree's by
# compileall, the rest by one small call of each kind the suite makes, forward and
# backward, in a Triton cache of its own (once a call)
bytecode() {
  [ -z "${PYC:-}" ] || [ -n "${PYTHONPYCACHEPREFIX:-}" ] && return 0
  export PYTHONPYCACHEPREFIX=/tmp/pycache
  python3 -m compileall -q -j 0 src >/dev/null 2>&1
  TRITON_CACHE_DIR=/tmp/pyc-triton python3 -c "import torch, fusedattn, fusedattn_lab.coldstart
for dt, d in ((torch.bfloat16, 64), (torch.bfloat16, 128), (torch.float32, 80)):
    q = torch.randn(1, 2, 256, d, device='cuda', dtype=dt, requires_grad=True)
    fusedattn.attention(q, q, q, is_causal=True).backward(torch.ones(1, 2, 256, d, device='cuda', dtype=dt))
    torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
torch.cuda.synchronize()" 2>&1 | tail -2
}
# fresh_row I SIDE FILE [LABEL]: coldstart.problems()[I] in a fresh process with an empty
# Triton cache (or started as $COLDMODE says: "after warmup", "after a primer"), with
# SIDE/src's library, its JSON line (naming LABEL, default SIDE) added to $ev/FILE and the log
fresh_row() {
  PYTHONPATH=/tmp/site:$2/src python3 -c "import json, sys; from fusedattn_lab.coldstart import problems, run_fresh
print(json.dumps(dict(run_fresh(problems()[int(sys.argv[1])], sys.argv[3]), side=sys.argv[2])))" "$1" "${4:-$2}" "${COLDMODE:-empty cache}" 2>&1 | tail -1 | tee -a "$ev/$3" | tee -a "$log"
}
# Nsight Compute of scripts/ncu_vs_cudnn.py's NVTX ranges fusedattn-fwd and PEER-fwd, or
# with PEER "-" every kernel between its profiler start and stop (--bwd-only: autograd's
# thread runs outside NVTX ranges):
# profile NAME PEER ARGS... writes $ev/ncu/NAME.csv
profile() {
  local name=$1 peer=$2; shift 2
  local only=(--nvtx --nvtx-include fusedattn-fwd/ --nvtx-include "$peer-fwd/")
  [ "$peer" = - ] && only=()
  mkdir -p $ev/ncu
  ncu --profile-from-start off --clock-control none "${only[@]}" --section SpeedOfLight --section LaunchStats --section Occupancy \
    --section WarpStateStats \
    --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,regex:sm__pipe_tensor_op_.*_cycles_active\.avg\.pct_of_peak_sustained_active' \
    --csv --page details python3 scripts/ncu_vs_cudnn.py "$@" > $ev/ncu/$name.csv 2>>"$log"
  echo "ncu $name: rc=$?" | tee -a "$log"
}
while [ $# -gt 0 ]; do
  step=$1; shift
  echo "=== $step $(date -u +%T)" | tee -a "$log"
  case $step in
    fa4) part=$1; shift; mkdir -p /tmp/fa4 && cp .peers/"$part"/* /tmp/fa4/
         if [ -f /tmp/fa4/install.sh ] && [ ! -d /tmp/fa4site/flash_attn ]; then
           bash /tmp/fa4/install.sh >>"$log" 2>&1 || rc=1
         fi
         python3 -c "import flash_attn.cute" 2>/dev/null && echo "fa4 imports" | tee -a "$log" ;;
    tier) # (its stamped lines also into $ev as they come: 22:31Z's tier, cut at 445 s on a
          # slow H100, brought back nothing of itself)
          python3 scripts/gpu_tier.py --out $ev 2>&1 | tee "$ev/tier-$(date -u +%H%M%S).log" \
            | tail -15 | tee -a "$log"; rc=$((rc | PIPESTATUS[0])) ;;
    apply|revert) name=$1; shift; f=notes/patches/$name.patch
         flags=$([ "$step" = revert ] && echo -R)
         if [ ! -f "$f" ]; then echo "no $f" | tee -a "$log"; rc=2
         elif patch -p1 --batch --forward $flags < "$f" >>"$log" 2>&1; then
           # every later step's evidence says the tree is not the commit's
           export FUSEDATTN_GIT_DIRTY=1
           echo "$step $f (sha256 $(sha256sum "$f" | cut -c1-16)): later steps run a tree" \
                "that is not the commit's" | tee -a "$log"
         else echo "$step $f failed" | tee -a "$log"; rc=1; fi ;;
    hopper) python3 -m pytest -q -p no:cacheprovider -o addopts= tests/test_hopper.py tests/test_plans.py tests/test_fp8.py 2>&1 | tail -25 | tee -a "$log"; rc=$((rc | PIPESTATUS[0])) ;;
    hopperbwd) python3 -m pytest -q -x -p no:cacheprovider -o addopts= tests/test_hopper_backward.py 2>&1 | tail -25 | tee -a "$log"; rc=$((rc | PIPESTATUS[0])) ;;
    pyk) file=$1 expr=$2; shift 2   # one test file's tests matching a -k expression
         python3 -m pytest -q -p no:cacheprovider -o addopts= "$file" -k "$expr" 2>&1 | tail -25 | tee -a "$log"; rc=$((rc | PIPESTATUS[0])) ;;
    bwd) d=$ev/bwd-$(date -u +%H%M%S); mkdir -p $d
         python3 scripts/hopper_bwd_check.py --out $d --only "${ONLY:-}" --rows "${ROWS:-all}" 2>&1 | grep -v "UserWarning\|exe_args" | tee -a "$log" ;;
    losscurves) mkdir -p $ev/loss-curves; python3 scripts/hf_loss_curves.py --out $ev/loss-curves 2>&1 | grep -v "UserWarning\|warn(" | tail -8 | tee -a "$log" ;;
    switchab) name=$1 values=$2; shift 2; d=$ev/switchab-$(date -u +%H%M%S); mkdir -p $d
              python3 scripts/switch_ab.py --switch "$name" --values "$values" --out $d \
                ${ABROWS:+--rows "$ABROWS"} ${ABENTRIES:+--entries} ${ABSET:+--set "$ABSET"} 2>&1 | grep -v "UserWarning" | tee -a "$log" ;;
    windowab) w=$1 shapes=$2; shift 2  # scripts/window_sinks_ab.py: windows W at shapes S
        mkdir -p $ev/window-paths; PYTHONPATH=src python3 scripts/window_sinks_ab.py \
          --windows "$w" --shapes "$shapes" --out $ev/window-paths/ab-$(date -u +%H%M%S).jsonl \
          2>&1 | grep -v UserWarning | tail -40 | tee -a "$log"; rc=$((rc | PIPESTATUS[0])) ;;
    check) python3 scripts/hopper_check.py --out $ev --sweep 2>&1 | grep -v "UserWarning\|exe_args" | tee -a "$log" ;;
    sweep) python3 scripts/hopper_check.py --out $ev --sweep-only 2>&1 | tee -a "$log" ;;
    varlensweep) python3 scripts/hopper_check.py --out $ev --varlen-sweep 2>&1 | grep -v "UserWarning" | tee -a "$log" ;;
    rows) d=$ev/rows-$(date -u +%H%M%S); mkdir -p $d
          python3 scripts/hopper_check.py --out $d --only "${ONLY:-hopper,hopper-sharedkv,cudnn,fa4}" --rows "${ROWIDX:-}" 2>&1 | grep -v "UserWarning\|exe_args" | tee -a "$log" ;;
    bench) suite=$1; shift
           case $suite in  # the serving suites' providers are their own (all of them)
             varlen|window|decode|sinks|mla|fp8) providers=${PROVIDERS:-all} ;;
             *) providers=${PROVIDERS:-flash,flash-portable,sdpa-cudnn,sdpa-flash,fa4} ;;
           esac
           python3 -m fusedattn_lab bench --suite "$suite" --out $ev \
             --providers "$providers" ${MATCH:+--match "$MATCH"} 2>&1 | tail -40 | tee -a "$log" ;;
    ncu) IFS=, read -r d b h s c <<<"$1"; shift
         case $c in causal) extra=--causal ;; varlen) extra=--varlen ;; *) extra= ;; esac
         profile ncu-d$d-b$b-h$h-s$s${c:+-$c} fa4 --peer fa4 --dim "$d" --batch "$b" \
           --heads "$h" --seq "$s" $extra ;;
    ncubwd) IFS=, read -r d b h s c <<<"$1"; shift
         case $c in varlen) extra=--varlen ;; "") extra= ;; *) extra=--causal ;; esac
         profile ncu-bwd-d$d-b$b-h$h-s$s${c:+-$c} - --bwd-only --backend hopper --dim "$d" --batch "$b" \
           --heads "$h" --seq "$s" $extra ;;
    ncusrc) IFS=, read -r d b h s c <<<"$1"; shift
         case $c in causal) extra=--causal ;; *) extra= ;; esac
         name=ncusrc-d$d-b$b-h$h-s$s${c:+-$c}${DTYPE:+-$DTYPE}${KNOB:+-${KNOB%%=*}}
         mkdir -p $ev/ncu
         ncu --profile-from-start off --clock-control none --nvtx --nvtx-include fusedattn-fwd/ \
           --section SourceCounters --section WarpStateStats --section SpeedOfLight \
           --import-source no -f -o $ev/ncu/$name python3 scripts/ncu_vs_cudnn.py --fwd-only \
           --dim "$d" --batch "$b" --heads "$h" --seq "$s" $extra ${KNOB:+--knob "$KNOB"} \
           ${DTYPE:+--dtype "$DTYPE"} >>"$log" 2>&1
         ncu -i $ev/ncu/$name.ncu-rep --page source --csv --print-source sass \
           > $ev/ncu/$name-sass.csv 2>>"$log"
         echo "ncusrc $name: rc=$? $(wc -l < $ev/ncu/$name-sass.csv) lines" | tee -a "$log" ;;
    ncuorder) IFS=, read -r d b h hk s c <<<"$1"; shift
         mkdir -p $ev/ncu
         for order in ${ORDERS:-down up}; do
           name=ncuorder-d$d-b$b-h$h-hk$hk-s$s${c:+-$c}-$order
           case $order in
             across) knobs=(--knob "backward.ORDER='down'" --knob backward.DOWN_ACROSS_HEADS=True) ;;
             heads) knobs=(--knob "backward.ORDER='down'" --knob backward.DOWN_ACROSS_HEADS=False) ;;
             *) knobs=(--knob "backward.ORDER='$order'") ;;
           esac
           ncu --profile-from-start off --clock-control none -k regex:_flash_bwd_sm90 \
             --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
             --metrics lts__t_sector_hit_rate.pct,lts__t_sectors_srcunit_tex_op_read.sum,dram__bytes_read.sum,dram__bytes_write.sum,sm__cycles_active.avg,sm__cycles_active.max,sm__cycles_elapsed.max \
             --csv --page details python3 scripts/ncu_vs_cudnn.py --bwd-only --backend hopper \
             --dim "$d" --batch "$b" --heads "$h" --heads-kv "$hk" --seq "$s" ${c:+--causal} \
             "${knobs[@]}" > $ev/ncu/$name.csv 2>>"$log"
           echo "ncuorder $name: rc=$?" | tee -a "$log"
         done ;;
    ncusrcbwd) IFS=, read -r d b h s c <<<"$1"; shift
         name=ncusrc-bwd-d$d-b$b-h$h-s$s${c:+-$c}${KNOB:+-${KNOB##*.}}
         name=${name%%=*}
         mkdir -p $ev/ncu
         ncu --profile-from-start off --clock-control none -k regex:_flash_bwd_sm90 \
           --section SourceCounters --section WarpStateStats --section SpeedOfLight \
           --import-source no -f -o $ev/ncu/$name python3 scripts/ncu_vs_cudnn.py --bwd-only \
           --backend hopper --dim "$d" --batch "$b" --heads "$h" --seq "$s" ${c:+--causal} \
           ${KNOB:+--knob "$KNOB"} >>"$log" 2>&1
         ncu -i $ev/ncu/$name.ncu-rep --page source --csv --print-source sass \
           > $ev/ncu/$name-sass.csv 2>>"$log"
         echo "ncusrcbwd $name: rc=$? $(wc -l < $ev/ncu/$name-sass.csv) lines" | tee -a "$log" ;;
    ncufp8) IFS=, read -r d b h s c <<<"$1"; shift
         profile ncu-fp8-d$d-b$b-h$h-s$s${c:+-$c} cudnn --dtype fp8 --dim "$d" --batch "$b" \
           --heads "$h" --seq "$s" ${c:+--causal} ;;
    ncudecode) kind=$1 d=$2; shift 2; mkdir -p $ev/ncu
         ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
           --section Occupancy --section LaunchStats --section WarpStateStats \
           -k 'regex:_flash_fwd|_fp8_decode' --launch-skip 2 --launch-count 1 --csv --page details \
           python3 scripts/decode_ncu.py "$kind" "$d" > $ev/ncu/decode-$kind-d$d.csv 2>>"$log"
         echo "ncudecode $kind $d: rc=$? $(wc -l < $ev/ncu/decode-$kind-d$d.csv) lines" | tee -a "$log" ;;
    decodetiles) dims=$1; shift; d=$ev/decode-tiles-$(date -u +%H%M%S); mkdir -p $d
         python3 scripts/decode_tiles.py --dims "$dims" --out $d 2>&1 | grep -v "UserWarning" | tee -a "$log" ;;
    splitsab) d=$ev/decode-splits-$(date -u +%H%M%S); mkdir -p $d
              python3 scripts/decode_splits_ab.py --out $d ${SPLITROWS:+--rows "$SPLITROWS"} \
                ${SPLITCOUNTS:+--counts "$SPLITCOUNTS"} 2>&1 | grep -v "UserWarning" | tee -a "$log" ;;
    fp8check) d=$ev/fp8check-$(date -u +%H%M%S); mkdir -p $d
              python3 scripts/hopper_fp8_check.py --out $d ${FP8SWEEP:+--sweep} --only "${ONLY:-}" 2>&1 | grep -v "UserWarning" | tee -a "$log" ;;
    hostprof) python3 scripts/host_profile.py --sweep --out $ev/host_profile.json 2>&1 | tail -90 | tee -a "$log" ;;
    hangrepro) python3 scripts/hang_repro.py --seconds "${HANGSECONDS:-300}" ${HANGARGS:-} \
        --out $ev/hang_repro${HANGTAG:-}.json 2>&1 | grep --line-buffered -v UserWarning | tee -a "$log" ;;
    hangvar) variant=$1; shift  # hangrepro with hopper.backward switches "A=1,B=2" ("-": none)
        sw=(); name=default
        if [ "$variant" != "-" ]; then
          for x in ${variant//,/ }; do sw+=(--switch "$x"); done; name=${variant//[^A-Za-z0-9_=]/_}
        fi
        python3 scripts/hang_repro.py --seconds "${HANGSECONDS:-300}" ${HANGARGS:-} "${sw[@]}" \
          --out "$ev/hang_repro-$name.json" 2>&1 \
          | grep --line-buffered -v UserWarning | tee -a "$log" ;;
    train) python3 scripts/host_profile.py --train --out $ev/train_profile.json 2>&1 | grep -v UserWarning | tail -120 | tee -a "$log" ;;
    hostrows) python3 scripts/host_profile.py --bench-rows --out $ev/host_rows.json 2>&1 | grep -v UserWarning | tail -120 | tee -a "$log" ;;
    directab) python3 scripts/host_profile.py --direct-ab --out $ev/direct_ab.json 2>&1 | grep -v UserWarning | tail -20 | tee -a "$log" ;;
    cp) layouts=$1; shift; n=$(nvidia-smi -L | wc -l); mkdir -p $ev/cp
        NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
          torchrun --nproc-per-node "$n" scripts/context_parallel_bench.py \
          $ev/cp/cp-$n-gpus.csv --layouts "$layouts" 2>&1 | grep -v Warning | tail -20 | tee -a "$log" ;;
    mergeab) other=$1; shift  # a folder holding an older tree's src/ (as hostab): merge_ab.py
        python3 scripts/merge_ab.py --base "$other" --out $ev/mergeab 2>&1 | grep -v UserWarning \
          | tee -a "$log"; rc=$((rc | PIPESTATUS[0])) ;;
    hostab) other=$1; shift  # an older tree's src/ (e.g. `git archive REV src | tar -x -C D`)
        python3 scripts/host_ab.py --base "$other" --out $ev/hostab 2>&1 | grep -v UserWarning \
          | tail -60 | tee -a "$log"; rc=$((rc | PIPESTATUS[0])) ;;
    coldstart) bytecode
               python3 -m fusedattn_lab bench --suite coldstart --out $ev 2>&1 | tail -20 | tee -a "$log" ;;
    coldrow) i=$1; shift; bytecode
             for _ in $(seq "${ROUNDS:-3}"); do fresh_row "$i" . "coldrow-$i.jsonl"; done ;;
    coldab) other=$1 i=$2; shift 2  # coldrow I, an older tree's src/ against this one
        # old, new, new, old ($ROUNDS each), fresh processes and empty caches throughout
        bytecode; python3 -m compileall -q -j 0 "$other/src" >/dev/null 2>&1
        for side in "$other" . . "$other"; do
          for _ in $(seq "${ROUNDS:-2}"); do fresh_row "$i" "$side" "coldab-$i.jsonl"; done
        done ;;
    coldenv) i=$1 setting=$2; shift 2  # coldrow I with VAR=VALUE set against unset
        # (set, unset, unset, set; $ROUNDS each), fresh processes and empty caches throughout
        bytecode
        for side in "$setting" default default "$setting"; do
          if [ "$side" = default ]; then unset "${setting%%=*}"; else export "$setting"; fi
          for _ in $(seq "${ROUNDS:-2}"); do fresh_row "$i" . "coldenv-$i.jsonl" "$side"; done
        done
        unset "${setting%%=*}" ;;
    prebuild) python3 scripts/prebuild.py --out $ev 2>&1 | grep -v "UserWarning" | tail -40 | tee -a "$log"
              rc=$((rc | PIPESTATUS[0])) ;;
    firstcall) bytecode; m=${MODE:-after warmup}
               python3 scripts/first_call_profile.py --out "$ev/first-call-${m// /-}" --problems "${PROBLEMS:-3,0}" --mode "${MODE:-after warmup}" 2>&1 | grep -v "UserWarning" | tail -120 | tee -a "$log" ;;
    *) echo "unknown step $step" | tee -a "$log"; rc=2 ;;
  esac
  [ -n "${OUT:-}" ] && pack step
done
if [ -n "${OUT:-}" ]; then  # the packer stopped first: its older copy must not land last
  kill $packer 2>/dev/null; wait 2>/dev/null
  pack step
  rm -f "$OUT/.ev.tgz.part"
fi
exit $rc
