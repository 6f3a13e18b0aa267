"""Tile configs for the library's kernels: a table tuned on the H200, then rules, so the
first call on a new shape costs one compile, not a search. Data and rules only: each rule
has a one-line reason here and its measurements in docs/decisions.md (the anchor named
beside it).

A config is `(BLOCK_M, BLOCK_N, num_warps, num_stages)`. Each kernel first looks its problem
up in the tuned table (`fusedattn tune` writes `tuned/<gpu>.json`, keyed by `table_key`);
a key the table lacks, or a GPU without a table, gets the rules. Other GPUs get the H200's
rules: a rule, not a promise of speed there. In emulation every kernel runs one small
config: the interpreter is exact whatever the tile, and slow on big ones. Autotuning
(Triton's `triton.autotune` over the candidates at the end) runs only on request.

Environment overrides, for A/B runs and tuning, are read once when fusedattn is imported,
never on a launch (`OVERRIDES`); tests and the A/B runner replace `configs.OVERRIDES`.
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import triton

from fusedattn.mode import EMULATION

Config = tuple[int, int, int, int]

SMS = 132  # the H200's streaming multiprocessors: a grid under this leaves SMs idle
EMULATED: Config = (16, 16, 1, 1)  # tl.dot wants tiles >= 16 on the GPU; kept in emulation
SHORT_SEQ = 256  # query lengths up to this take small query tiles (the autotuner too)

TUNED_DIR = Path(__file__).parent / "tuned"
TABLE_ENV = "FUSEDATTN_TUNED_TABLE"
_LOADED: dict[str, dict] = {}


@dataclass(frozen=True)
class Overrides:
    """What the environment overrides, read once (`from_env`)."""

    autotune: bool = False        # FUSEDATTN_AUTOTUNE=1: time the candidates on each shape
    one_loop: bool | None = None  # FUSEDATTN_ONE_LOOP=1/0: force one key loop or several
    split_d: bool = True          # FUSEDATTN_SPLIT_D=0: every head dim one padded piece
    index64: bool = False         # FUSEDATTN_INDEX64=1: 64-bit offsets always (their cost)
    table: Path | None = None     # FUSEDATTN_TUNED_TABLE=path: another tuned table
    fp8_decode: bool = False      # FUSEDATTN_FP8_DECODE=1: e4m3 decode on `tiles.fp8_decode`
    # (off until the GPU has run and timed it: notes/next-device-calls.md)

    @classmethod
    def from_env(cls, env=os.environ) -> Overrides:
        loop = env.get("FUSEDATTN_ONE_LOOP", "")
        return cls(autotune=env.get("FUSEDATTN_AUTOTUNE", "") == "1",
                   one_loop=loop == "1" if loop in ("0", "1") else None,
                   split_d=env.get("FUSEDATTN_SPLIT_D", "") != "0",
                   index64=env.get("FUSEDATTN_INDEX64", "") == "1",
                   table=Path(env[TABLE_ENV]) if env.get(TABLE_ENV) else None,
                   fp8_decode=env.get("FUSEDATTN_FP8_DECODE", "") == "1")


OVERRIDES = Overrides.from_env()


@functools.cache
def gpu_family() -> str | None:
    """This GPU's name as a file stem ("nvidia-h200"); None without a GPU (asked once)."""
    import torch

    if EMULATION or not torch.cuda.is_available():
        return None
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")


def table_path() -> Path | None:
    """The tuned table in use: $FUSEDATTN_TUNED_TABLE, else this GPU's committed one."""
    if OVERRIDES.table is not None:
        return OVERRIDES.table
    family = gpu_family()
    return TUNED_DIR / f"{family}.json" if family else None


_KEY = re.compile(r"(fwd|bwd|decode) (16bit|ieee|tf32|tf32x3) d\d+ (causal|full) s\d+ "
                  r"(fills|few)")


def _check_config(c: object) -> bool:
    """A config `[BLOCK_M, BLOCK_N, num_warps, num_stages]`: tiles powers of two in 16..256,
    warps a power of two in 1..16, stages in 1..8."""
    def pow2(x, low, high):
        return isinstance(x, int) and not isinstance(x, bool) and low <= x <= high \
            and x & (x - 1) == 0

    return (isinstance(c, list) and len(c) == 4 and pow2(c[0], 16, 256)
            and pow2(c[1], 16, 256) and pow2(c[2], 1, 16) and isinstance(c[3], int)
            and not isinstance(c[3], bool) and 1 <= c[3] <= 8)


def load_table(path: Path) -> dict[str, list]:
    """A tuned table's entries, validated: `{"entries": {key: config}}`, each key as
    `table_key` writes it, a config for "fwd" and "decode", two (dK/dV, dQ) for "bwd".
    A missing file is no table ({}: the rules serve); anything malformed raises
    ProblemError naming the file and what is wrong."""
    from fusedattn.problem import ProblemError

    field = f"tuned table {path}"
    if not path.exists():
        return {}
    try:
        entries = json.loads(path.read_text())["entries"]
    except (OSError, ValueError, KeyError, TypeError) as err:  # JSON and decode errors too
        raise ProblemError(field, f"unreadable ({type(err).__name__}: {err})",
                           '{"entries": {key: config}}, as `fusedattn tune` writes it') from None
    if not isinstance(entries, dict):
        raise ProblemError(field, "entries of another type", "an object of key: config")
    for key, value in entries.items():
        if not _KEY.fullmatch(key):
            raise ProblemError(field, f"key {key!r}", "keys as 'fwd 16bit d128 causal s4096 "
                               "fills' (kernel, precision, head dim, mask, bucket, grid)")
        configs = value if key.startswith("bwd") else [value]
        if not (isinstance(value, list) and len(configs) == (2 if key.startswith("bwd")
                else 1) and all(_check_config(c) for c in configs)):
            raise ProblemError(field, f"{key!r}: {value!r}", "[BLOCK_M, BLOCK_N, warps, "
                               "stages] (two of them for 'bwd': dK/dV, dQ), tiles powers of "
                               "two in 16..256, warps in 1..16, stages in 1..8")
    return entries


def tuned_table() -> dict[str, list]:
    """The entries of the table in use ({} when there is none), read and validated once
    per path per process (every kernel launch asks: no file access after the first)."""
    path = table_path()
    if path is None:
        return {}
    key = str(path)
    if key not in _LOADED:
        _LOADED[key] = load_table(path)
    return _LOADED[key]


def fills_sms(programs: int, seq: int) -> bool:
    """Whether `programs` per 64-row tile position, over `seq` rows, fill the SMs."""
    return programs * triton.cdiv(seq, 64) >= SMS


def table_key(kernel: str, *, precision: str | None, dim: int, causal: bool, seq: int,
              programs: int) -> str:
    """A table key: kernel ("fwd", "bwd", "decode"), precision ("16bit" for fp16/bf16),
    padded head dim, causal or not, the sequence's power-of-two bucket (64..16384) and
    whether `programs` (programs per tile row times 64-row tiles) fill the SMs."""
    block_d = max(16, triton.next_power_of_2(dim))
    bucket = min(max(triton.next_power_of_2(seq), 64), 16384)
    return (f"{kernel} {precision or '16bit'} d{block_d} {'causal' if causal else 'full'} "
            f"s{bucket} {'fills' if fills_sms(programs, seq) else 'few'}")


def _tuned(kernel: str, **key) -> list | None:
    return tuned_table().get(table_key(kernel, **key))


def autotune_requested() -> bool:
    """`FUSEDATTN_AUTOTUNE=1`: time the candidate configs on each new shape (a search of
    seconds to minutes per shape) instead of taking the table's config."""
    return OVERRIDES.autotune and not EMULATION


def forward_config(*, dim: int, seq_q: int, programs_per_tile_row: int, causal: bool,
                   precision: str | None) -> Config:
    """The forward's config. `programs_per_tile_row`: B * H (programs per query tile
    position); `precision`: "ieee" for exact fp32 (FMA on CUDA cores), else tensor cores."""
    if EMULATION:
        return EMULATED
    hit = _tuned("fwd", precision=precision, dim=dim, causal=causal, seq=seq_q,
                 programs=programs_per_tile_row)
    if hit:
        return tuple(hit)
    block_d = max(16, triton.next_power_of_2(dim))
    fills = fills_sms(programs_per_tile_row, seq_q)
    if triton.next_power_of_2(seq_q) <= SHORT_SEQ:
        # short queries: a 64-row tile is the whole head; smaller tiles fill the SMs
        tensor_tiles = precision is None or (precision != "ieee" and block_d <= 64)
        return (64, 64, 4, 3) if fills and tensor_tiles else (32, 32, 4, 2)
    if precision is not None and block_d <= 128 and not fills:
        # fp32, SMs idle: 32-row tiles, twice the programs (decisions.md#fp32-few-programs)
        return (32, 32, 4, 2) if precision == "ieee" else (32, 64, 4, 2)
    if precision == "ieee":
        # the FMA winner at D64; past 128 smaller, FMA dots unroll (decisions.md#fp32-ieee)
        return (64, 64, 4, 2) if block_d <= 128 else (32, 32, 4, 2)
    if precision is not None and block_d > 64:
        # fp32 on tensor cores: 4-byte tiles, fewer stages fit (decisions.md#fp32-tensor-cores)
        return (64, 64, 4, 2) if block_d == 128 else (64, 32, 4, 1)
    if block_d > 128:
        # 128 rows, 8 warps, 2 stages of 64 keys fit 256 columns (decisions.md#d256)
        return (128, 64, 8, 2)
    if block_d == 128 and causal:
        return (64, 64, 4, 3)
    if block_d == 128:
        return (128, 128, 8, 3)
    return (128, 64, 8, 3)


ONE_LOOP_MAX_KEYS = 2048  # one loop up to here: half the compile (decisions.md#one-key-loop)


def single_key_loop(*, seq_k: int, precision: str | None, has_left: bool) -> bool:
    """One loop (see above) for fp32 (any precision: big tiles of code), windows with a
    left edge (masked tiles at both ends) and up to ONE_LOOP_MAX_KEYS keys; two otherwise.
    $FUSEDATTN_ONE_LOOP=1/0 forces it (the backward's rule: `backward_single_loop`)."""
    if OVERRIDES.one_loop is not None:
        return OVERRIDES.one_loop
    return precision is not None or has_left or seq_k <= ONE_LOOP_MAX_KEYS


def head_dim_pieces(dim: int, *, precision: str | None, aligned: bool = True
                    ) -> tuple[int, int]:
    """(first, second) pieces of the forward's head dim for fp16/bf16 (`precision` None):
    powers of two, the first 64 or more and half the padded dim, the second (16 or more)
    the smallest that covers the rest, where together they are narrower than the padded dim
    (1.05-1.21x faster: decisions.md#head-dim-pieces); else (a power of two >= dim, 0), one
    piece, padded. A second piece wider than what is left overlaps the first (D72 = 64 +
    16, its columns 56..71): every load stays inside the row, unmasked, and the overlap
    counts once (`flash._flash_fwd`). `aligned`: every row of Q, K and V starts on 16
    bytes (`common.row_alignment`); pieces in unaligned rows went wrong on the H200, so
    there one piece. Three pieces and fp32 pieces ran slower and are not made.
    $FUSEDATTN_SPLIT_D=0 (`OVERRIDES.split_d`): one piece always."""
    whole = max(16, triton.next_power_of_2(dim))
    first, rest = whole // 2, dim - whole // 2
    if precision is not None or not aligned or first < 64 or whole == dim \
            or not OVERRIDES.split_d:
        return whole, 0
    second = max(16, triton.next_power_of_2(rest))
    return (first, second) if first + second < whole else (whole, 0)


BWD_ONE_LOOP_MAX = 256  # one loop for masks and short loops (decisions.md#backward-loops)


def backward_single_loop(*, seq: int, precision: str | None, has_left: bool,
                         has_right: bool) -> bool:
    """One loop in a backward kernel whose loop walks `seq` rows: for fp32, any mask
    edge (causal, a window) and loops up to BWD_ONE_LOOP_MAX rows; three otherwise.
    $FUSEDATTN_ONE_LOOP=1/0 forces it, as in the forward."""
    if OVERRIDES.one_loop is not None:
        return OVERRIDES.one_loop
    return precision is not None or has_left or has_right or seq <= BWD_ONE_LOOP_MAX


def decode_config(*, dim: int, rows: int, seq_k: int = 0, programs: int = SMS,
                  precision: str | None = None, fp8: bool = False) -> Config:
    """Few query rows per K/V head (decode: Sq * H / H_kv rows with GQA packing, split
    across programs along the keys): the smallest tile that tl.dot takes and holds them, and
    key tiles wide enough to stream K and V at memory speed. The tuned table is keyed by the
    rows as its "sequence" and `programs` (B * H_kv * splits). `fp8` (e4m3 K and V) takes
    the rule: the table's entries were timed in 16 bits, and e4m3 tiles cost otherwise (at
    D128 the bf16 entry's 64 keys took 0.195 ms, the rule's 128 0.172: decode_tiles
    0448Z)."""
    if EMULATION:
        return EMULATED
    hit = _tuned("decode", precision=precision, dim=dim, causal=False, seq=rows,
                 programs=programs) if seq_k and not fp8 else None
    if hit:
        return tuple(hit)
    block_m = min(64, max(16, triton.next_power_of_2(rows)))
    return (block_m, 64 if dim > 128 else 128, 4, 3)


def fp8_decode_config(*, dim: int, rows: int) -> Config:
    """`tiles.fp8_decode`'s tile: (BLOCK_R query rows, BLOCK_N keys, warps, stages). The
    rows are S^T's N (16 at least: tl.dot's); the keys its M, 64 at least for wgmma. One
    warpgroup, two stages, 128 keys (64 at D256): built for sm_90a, a key costs the fewest
    issue slots there of the tiles that keep shared memory at 86 KiB or less (two programs
    an SM) and spill nothing: at D128 16.2 instructions x warps a key, against 20.6 at 64
    keys and 19.7 with 8 warps (256 keys: 16.5, with spills and 170 KiB); at D256, 31.1 at
    64 keys (128 keys: 26.8 at 168 KiB, spilling); at D64 12.3 (256 keys: 10.6 at 243
    registers). evidence/sm90-compile/20261205T0626Z-fp8-decode-deferred-sum. A compiler's
    count: not timed yet (`scripts/decode_tiles.py` times them)."""
    if EMULATION:
        return EMULATED
    return (max(16, triton.next_power_of_2(rows)), 64 if dim > 128 else 128, 4, 2)


def decode_splits(*, programs: int, seq_k: int) -> int:
    """How many splits of the keys a decode call takes: the largest power of two that keeps
    the grid within one wave (programs x splits <= SMS), with at least 256 keys a split
    (a split's partials cost a write and a read of [rows, D] fp32) and at most 64. A grid
    of a program an SM or more takes one split: one launch a call, no merge.
    Measured on an H100 (evidence/nvidia-h100/20261206T0222Z-decode-splits): a program
    streams its keys at about 55 GB/s, so 64 programs or more keep the memory busy; at
    64-512 programs one or two splits ran 1-10% faster than the four programs an SM this
    rule had asked for (B32 H32/8 8192 keys: 354 against 362 us), at 8-32 programs the
    power of two under one wave was the best count timed, and 3 splits (which cut these
    power-of-two lengths unevenly; not profiled) ran up to 5% slower than 2 or 4."""
    most = max(1, min(SMS // max(1, programs), triton.cdiv(seq_k, 256), 64))
    return 1 << (most.bit_length() - 1)


# the backward per padded head dim (fp32 counts twice): decisions.md#backward-tiles
BACKWARD: dict[int, tuple[Config, Config]] = {
    # head dim up to: (dkdv, dq)
    64: ((32, 64, 4, 3), (128, 64, 8, 3)),
    128: ((64, 128, 8, 2), (128, 128, 8, 2)),
    256: ((32, 64, 8, 2), (64, 32, 4, 1)),
}
# fp32 past the 128 bucket (tf32 at D > 64, tf32x3 at any D: twice the bytes, and tf32x3
# splits each operand in two): the small tiles it passed the GPU tier with (not retimed)
BACKWARD_FP32_WIDE: tuple[Config, Config] = ((32, 64, 4, 1), (64, 32, 4, 1))


# exact fp32: small tiles keep the FMA dots' compile in seconds (decisions.md#backward-ieee)
BACKWARD_IEEE: tuple[Config, Config] = ((32, 32, 4, 2), (32, 32, 4, 2))


def backward_configs(*, dim: int, itemsize: int, precision: str | None = None,
                     causal: bool = False, seq: int = 0,
                     programs: int = SMS) -> tuple[Config, Config]:
    """(dK/dV config, dQ config) of the backward; `precision` as in `forward_config`;
    `causal`, `seq` (keys) and `programs` (B * H_kv) key the tuned table."""
    if EMULATION:
        return EMULATED, EMULATED
    hit = _tuned("bwd", precision=precision, dim=dim, causal=causal, seq=seq,
                 programs=programs) if seq else None
    if hit:
        return tuple(hit[0]), tuple(hit[1])
    if precision == "ieee":
        return BACKWARD_IEEE
    if precision == "tf32x3":
        # each product split in high and low parts: D=64's tiles overran shared memory on
        # the H200 (OutOfResources, train-fp32 bench of 7b1e2ec); the small tiles fit
        return BACKWARD_FP32_WIDE
    block_d = max(16, triton.next_power_of_2(dim)) * max(1, itemsize // 2)
    if block_d > 128 and itemsize > 2:
        return BACKWARD_FP32_WIDE
    return next(c for d, c in BACKWARD.items() if min(block_d, 256) <= d)


# --- the autotuner's candidates (FUSEDATTN_AUTOTUNE=1, `fusedattn bench --configs`) -----

# the candidates that won on the H200, by kind (decisions.md#autotune-candidates)
TENSOR_CORE = ((128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 32, 4, 4))
FMA = ((64, 32, 4, 2), (64, 64, 4, 2), (64, 64, 8, 2), (128, 32, 8, 2), (128, 64, 8, 2),
       (32, 64, 4, 2), (64, 32, 4, 3), (32, 32, 2, 2), (128, 64, 4, 3))
SHORT = ((64, 64, 4, 3), (32, 32, 4, 2), (16, 32, 2, 2), (16, 16, 1, 1))


def _shape(c: triton.Config) -> tuple[int, int, int, int]:
    return c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages


CONFIGS = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
           for bm, bn, w, st in dict.fromkeys(TENSOR_CORE + FMA + SHORT)]


def candidates(configs, head_dim: int, bucket_q: int, precision) -> list:
    """The configs worth timing for one problem: the short-sequence set for short queries,
    else both sets for fp32-ieee and the tensor-core set otherwise; for head dims over 128
    only tiles of <= 64 keys, and 128 rows only with 8 warps (K, V and an accumulator of 256
    columns overfill a Hopper SM's shared memory and registers past that)."""
    if bucket_q <= SHORT_SEQ:
        sets = SHORT
    else:
        sets = TENSOR_CORE + FMA if precision == "ieee" else TENSOR_CORE
    keep = [c for c in configs if _shape(c) in sets]
    if head_dim > 128:
        keep = [c for c in keep if c.kwargs["BLOCK_N"] <= 64
                and (c.kwargs["BLOCK_M"] <= 64 or c.num_warps == 8)]
    return keep or configs[:1]


def prune_configs(configs, named_args, **kwargs):
    """The autotuner's early prune: `candidates` for the launch's arguments (the head dim
    comes divided by ALIGN: `_flash_fwd`; the wider of Q's and V's decides)."""
    args = {**named_args, **kwargs}
    dim = max(args["head_dim"], args.get("head_dim_v", 0))
    return candidates(configs, dim * args.get("ALIGN", 1), args["bucket_q"],
                      args["PRECISION"])
