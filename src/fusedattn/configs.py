"""Tile configs for the library's kernels: a table tuned on the H200 and a rule for the
rest, so the first call on a new shape costs one compile, not a search.

A config is `(BLOCK_M, BLOCK_N, num_warps, num_stages)`. Autotuning (Triton's
`triton.autotune` over the candidate sets below) runs only on request:
`FUSEDATTN_AUTOTUNE=1` in the environment, read at each call. In emulation every kernel
runs one small config: the interpreter is exact whatever the tile, and slow on big ones.

Where the numbers come from: the forward's winners of `fusedattn bench --configs` on the
H200 (evidence/nvidia-h200/20261130T044344Z-tune-bf16, ...044457Z-tune-fp32); the
backward's of `scripts/bwd_configs.py` (evidence/README.md, "Training"). Other GPUs get
the same table: a rule, not a promise of speed there.

Before the rules, each kernel looks its problem up in a tuned table: `fusedattn tune` times
the candidates on the GPU it runs on and writes `tuned/<gpu>.json` (e.g. `nvidia-h200`),
keyed by kernel, precision, padded head dim, causal or not, the sequence's power-of-two
bucket and whether the grid fills the SMs (`table_key`). `FUSEDATTN_TUNED_TABLE=path` reads
another table instead. A key the table lacks (or a GPU without a table) gets the rules.
"""

from __future__ import annotations

import functools
import json
import os
import re
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


@functools.cache
def gpu_family() -> str | None:
    """This GPU's name as a file stem ("nvidia-h200"); None without a GPU (asked once)."""
    import torch

    if EMULATION or not torch.cuda.is_available():
        return None
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")


def table_path() -> Path | None:
    """The tuned table in use: $FUSEDATTN_TUNED_TABLE, else this GPU's committed one."""
    if os.environ.get(TABLE_ENV):
        return Path(os.environ[TABLE_ENV])
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
    return os.environ.get("FUSEDATTN_AUTOTUNE", "") == "1" and not EMULATION


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
        # fp32 on a grid of 64-row tiles that leaves SMs idle: 32-row tiles, twice the
        # programs and a quarter (half) of the unrolled products to compile. B1 H4 S700 D96
        # on the H200 (scripts/fwd_configs.py --fp32, 20261130T1636Z): exact 0.161 against
        # 0.350 ms with the 64x64 tiles, compiled in 1.34 s; tf32x3 0.058 against 0.109 ms
        # (13.0 TFLOP/s, SDPA efficient 11.1), compiled in 1.48 s against about 2
        return (32, 32, 4, 2) if precision == "ieee" else (32, 64, 4, 2)
    if precision == "ieee":
        # the FMA winner at S=4096 D=64 (12.3 TFLOP/s); past D=128 smaller tiles, as the
        # FMA dot unrolls to M*N*D/threads instructions (never timed: not run on the GPU)
        return (64, 64, 4, 2) if block_d <= 128 else (32, 32, 4, 2)
    if precision is not None and block_d > 64:
        # fp32 on tensor cores (tf32, tf32x3, the fp32 default): tiles of 4-byte words, so
        # the 16-bit rules' D=128 tiles would need 384 KB of shared memory. D=128: 64-row
        # tiles, 2 stages (160 KB); past 128: one stage of K and V
        return (64, 64, 4, 2) if block_d == 128 else (64, 32, 4, 1)
    if block_d > 128:
        # K, V and a 256-column accumulator: 128-row tiles fit with 8 warps and 2 stages of
        # 64 keys (192 KB of shared memory); 1.17x the 64-row tiles of 4 warps at B2 H16
        # S4096 (510 against 436 TFLOP/s, scripts/fwd_configs.py, 20261130T1550Z)
        return (128, 64, 8, 2)
    if block_d == 128 and causal:
        return (64, 64, 4, 3)
    if block_d == 128:
        return (128, 128, 8, 3)
    return (128, 64, 8, 3)


# One key loop or two (`flash._key_tiles`): the forward either runs its whole tiles and its
# mask-edge tiles (causal diagonal, window edges, the ragged last tile) as separate
# instantiations of the loop -- no compare, select or load mask on the whole ones -- or as one
# loop that masks a tile when it is on an edge (a branch per tile, masked loads). One loop is
# half the code: the compile takes about half as long (bf16 S1000 D128 on the H200: 0.93 s
# against 2.02; fp32 S700 D96: 1.99 against 3.64), and short loops run faster without a second
# pipeline to fill. Two loops win on long 16-bit loops. A/B on the H200
# (evidence/nvidia-h200/20261130T1536Z-ab-one-loop), one loop over two: B64 S256 1.21x and
# causal 1.28x, window 1.09x, S1000 1.03-1.04x, fp32 ieee S4096 1.63x, fp32 tf32x3 S4096 0.98x;
# bf16 S4096 D128 0.90x, D64 0.95x, S16384 D80 0.90x, causal 0.98x.
ONE_LOOP_MAX_KEYS = 2048
ONE_LOOP_ENV = "FUSEDATTN_ONE_LOOP"  # "1" or "0" overrides the rule (A/B runs), read per call


def single_key_loop(*, seq_k: int, precision: str | None, has_left: bool) -> bool:
    """One loop (see above) for fp32 (any precision: big tiles of code), windows with a
    left edge (masked tiles at both ends) and up to ONE_LOOP_MAX_KEYS keys; two otherwise.
    $FUSEDATTN_ONE_LOOP=1/0 forces it (the backward's rule: `backward_single_loop`)."""
    forced = _forced_one_loop()
    if forced is not None:
        return forced
    return precision is not None or has_left or seq_k <= ONE_LOOP_MAX_KEYS


def _forced_one_loop() -> bool | None:
    forced = os.environ.get(ONE_LOOP_ENV, "")
    return forced == "1" if forced in ("0", "1") else None


# Head dims that are not powers of two: tl.dot takes power-of-two tiles, so D=80 padded to
# 128 multiplies 48 columns of zeros in both products (1.6x the tensor-core work). Split in
# two pieces instead, 64 + 16, each product is two dots over the pieces and nothing is
# padded; 96 = 64 + 32, 144 = 128 + 16, 160 = 128 + 32, 192 = 128 + 64. On the H200, bf16
# B2 H16 S4096, split over padded (scripts/ab_forward.py --suite ab-split at c76e01e,
# evidence/nvidia-h200/20261130T1835Z-ab-split-d): D80 1.11x (causal 1.21x, S16384 1.10x),
# D96 1.09x (causal 1.05x), D144 1.13x, D160 1.13x, D192 1.06x; but D48 (32 + 16) 0.99x and
# fp32 (tf32x3) D96 S700 0.61x, so fp32 and first pieces under 64 pad. Pieces past the
# first went wrong on the H200 wherever the rows of Q, K, V
# do not start on 16 bytes as far as Triton knows (a row stride not a multiple of 16
# elements; bf16 B1 H2 S2600, against SDPA in fp32: the probes in
# evidence/nvidia-h200/20261130T2000Z-split-d-unaligned-probe): the pieces' columns off by
# up to 0.37, or an illegal memory access, both for a masked padded piece (72 as 64 + 16 at
# a4015e1, 20261130T1830Z-split-d-padded-probe) and for whole pieces (D80 in rows of 88,
# D96 in rows of 104), while one piece was right at every stride tried (D8 to D128). The
# compiled code differs there: with unaligned rows Triton loads each tile element by
# element, unpipelined, straight into the shared memory the async wgmma reads; aligned, it
# copies them by cp.async into multi-buffered shared memory. So pieces are used only where
# every row starts on 16 bytes and the head dim is a multiple of 16 bytes
# (`common.row_alignment`). Where Triton cannot see that itself (a stride or the head dim
# not a multiple of 16), the strides and the head dim reach the kernel divided by 8 and are
# multiplied back there (`_flash_fwd`'s ALIGN), which tells Triton so -- for every head dim,
# split or not: padded D72 ran 2.05x faster with it (bf16 B2 H16 S4096, the padded sides
# of evidence/nvidia-h200/20261130T2010Z-ab-overlap-d and 2020Z-ab-overlap-d), and D200
# (padded to 256) 2.05x (the prefill suite, 201200Z against 202200Z).
# A last piece wider than what is left is not masked but overlaps the piece before it: D72
# = 64 + 16 reads columns 0..63 and 56..71, every load unmasked and inside the row; Q's
# overlapped columns are zeros in the second piece, and the output stores them from the
# first only (`_forward_tile`, OVERLAP). Three whole pieces where two do not exist
# (112 = 64 + 32 + 16, 176 = 128 + 32 + 16, 208 = 128 + 64 + 16, 224 = 128 + 64 + 32) ran
# slower than one padded piece (scripts/ab_forward.py --suite ab-split3 at fe1f6b8,
# evidence/nvidia-h200/20261130T1906Z-ab-split3-d): D112 0.88x (causal 0.84x), D176 0.99x,
# D208 0.99x, D224 0.96x; and D200 as 128 + 64 + 16 overlapping, 0.94x (at 4855946,
# 2021Z-ab-split3-d); so they pad unless asked for. Two overlapping pieces over one padded
# piece, both aligned (2020Z-ab-overlap-d): D72 1.05x (causal 1.09x, S16384 1.04x), D88
# 1.07x, D136 1.20x, D168 1.04x, D176 1.07x. The forward only: the backward pads.
SPLIT_D_ENV = "FUSEDATTN_SPLIT_D"  # "0" pads every head dim, "3" allows three pieces (A/B)


def head_dim_pieces(dim: int, *, precision: str | None, aligned: bool = True
                    ) -> tuple[int, int, int]:
    """(first, second, third) pieces of the forward's head dim for fp16/bf16 (`precision`
    None): powers of two, the first 64 or more and half the padded dim, the second (16 or
    more) the smallest that covers the rest, where together they are narrower than the
    padded dim (third 0); else (a power of two >= dim, 0, 0), one piece, padded. A last
    piece wider than what is left overlaps the piece before it (D72 = 64 + 16, its second
    piece columns 56..71): every load stays inside the row, unmasked, and the overlap
    counts once (`_forward_tile`). `aligned`: every row of Q, K and V starts on 16 bytes
    (`common.row_alignment`); where not, one piece (see above). $FUSEDATTN_SPLIT_D=0: one
    piece always; =3: three pieces (the second half the first, the third 16 or more) where
    two are no narrower than padding."""
    whole = max(16, triton.next_power_of_2(dim))
    first, rest = whole // 2, dim - whole // 2
    forced = os.environ.get(SPLIT_D_ENV, "")
    if precision is not None or not aligned or first < 64 or whole == dim or forced == "0":
        return whole, 0, 0
    second = max(16, triton.next_power_of_2(rest))
    if first + second < whole:
        return first, second, 0
    second = first // 2  # the largest power of two below `rest`
    third = max(16, triton.next_power_of_2(rest - second))
    if forced == "3" and first + second + third < whole:
        return first, second, third
    return whole, 0, 0


# Several (batch, head)s per program (`_flash_fwd`'s HEADS): one program walks HEADS of them
# one after another, meant for short sequences (B64 H16 S256: 4096 programs of one 64-row
# tile), to pay each program's prologue once per HEADS tiles. It lost everywhere it was
# timed on the H200 (scripts/ab_forward.py --suite ab-heads at 1dd4b72,
# evidence/nvidia-h200/20261130T1843Z-ab-heads-2 and ...1844Z-ab-heads-4), HEADS=2 and 4
# against 1: bf16 D64 B64 S256 0.75x (causal 0.75x, 0.72x), B64 S128 0.75x, B32 S512
# 0.71-0.73x, B16 S1024 0.74-0.76x, D128 B64 S256 causal 0.99x/0.94x. So the rule is 1 and
# HEADS stays a switch for A/B runs and tuning.
HEADS_ENV = "FUSEDATTN_HEADS"  # a count forces it where it applies (A/B runs), read per call


def heads_per_program(*, programs: int) -> int:
    """How many (batch, head)s each forward program walks, of `programs` (B * H):
    $FUSEDATTN_HEADS=n forces n where it divides them; 1 otherwise (the rule: above)."""
    forced = os.environ.get(HEADS_ENV, "")
    if forced.isdigit() and int(forced) > 0:
        return int(forced) if programs % int(forced) == 0 else 1
    return 1


# The backward's loops (dK/dV over the query tiles, dQ over the key tiles), one against three
# in one process on the H200 (scripts/ab_forward.py --suite ab-train,
# evidence/nvidia-h200/20261130T1634Z-ab-bwd-one-loop), one over three: causal 1.03-1.08x at
# S 1024-4096 (D64 and D128), B64 S256 1.05x (causal 1.11x), fp32 1.01x, but without a mask
# 0.94-0.96x at S 1024-4096: there the three loops' masked ones are empty (or one ragged
# tile) and one loop pays for bounded loads on every tile. One loop halves the compile
# (fwd+bwd S1000: the backward's two kernels 1.06-1.08 s against 1.83-2.12).
BWD_ONE_LOOP_MAX = 256


def backward_single_loop(*, seq: int, precision: str | None, has_left: bool,
                         has_right: bool) -> bool:
    """One loop in a backward kernel whose loop walks `seq` rows: for fp32, any mask
    edge (causal, a window) and loops up to BWD_ONE_LOOP_MAX rows; three otherwise.
    $FUSEDATTN_ONE_LOOP=1/0 forces it, as in the forward."""
    forced = _forced_one_loop()
    if forced is not None:
        return forced
    return precision is not None or has_left or has_right or seq <= BWD_ONE_LOOP_MAX


def decode_config(*, dim: int, rows: int, seq_k: int = 0, programs: int = SMS,
                  precision: str | None = None) -> Config:
    """Few query rows per K/V head (decode: Sq * H / H_kv rows with GQA packing, split
    across programs along the keys): the smallest tile that tl.dot takes and holds them, and
    key tiles wide enough to stream K and V at memory speed. The tuned table is keyed by the
    rows as its "sequence" and `programs` (B * H_kv * splits)."""
    if EMULATION:
        return EMULATED
    hit = _tuned("decode", precision=precision, dim=dim, causal=False, seq=rows,
                 programs=programs) if seq_k else None
    if hit:
        return tuple(hit)
    block_m = min(64, max(16, triton.next_power_of_2(rows)))
    return (block_m, 64 if dim > 128 else 128, 4, 3)


def decode_splits(*, programs: int, seq_k: int) -> int:
    """How many splits of the keys give the SMs about four programs each, with at least 256
    keys per split (a split's partials cost a write and a read of [rows, D] fp32)."""
    want = triton.cdiv(4 * SMS, max(1, programs))
    return max(1, min(want, triton.cdiv(seq_k, 256), 64))


# The backward, per padded head dim (fp32 counts twice its head dim: twice the bytes).
# dK/dV holds two [BLOCK_N, D] fp32 accumulators and the K and V tiles for its whole loop and
# streams query tiles past them; dQ the reverse. The fastest at bf16 B4 H32 S4096
# (scripts/bwd_configs.py): dQ's in all four of D64/D128 x causal or not, dK/dV's in three
# (D128 causal ran 4% faster with 3 stages). Past 128 (bf16/fp16), dK/dV's two [BLOCK_N, 256]
# fp32 accumulators took 256 registers a thread at 64 keys and 4 warps and spilled (ncu
# 20261130T1454Z: SM 11% busy, DRAM 43%); with 8 warps and 2 stages it ran 1.72x faster
# (B2 H16 S4096: 7.43 ms, causal 2.22x: 4.88; scripts/bwd_configs.py, 20261130T1457Z).
BACKWARD: dict[int, tuple[Config, Config]] = {
    # head dim up to: (dkdv, dq)
    64: ((32, 64, 4, 3), (128, 64, 8, 3)),
    128: ((64, 128, 8, 2), (128, 128, 8, 2)),
    256: ((32, 64, 8, 2), (64, 32, 4, 1)),
}
# fp32 past the 128 bucket (tf32 at D > 64, tf32x3 at any D: twice the bytes, and tf32x3
# splits each operand in two): the small tiles it passed the GPU tier with (not retimed)
BACKWARD_FP32_WIDE: tuple[Config, Config] = ((32, 64, 4, 1), (64, 32, 4, 1))


# Exact fp32 ("ieee") dots are FMA loops on CUDA cores that Triton unrolls to
# M*N*D/threads instructions per dot: tensor-core tiles (128x128 at D=64) took 64-76 s to
# compile each in the GPU tier of ccb29d2. Small tiles keep the compile in seconds; exact
# fp32 is the correctness path, not the fast one.
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

# Hopper configs, (BLOCK_M, BLOCK_N, warps, stages). Tensor cores (fp16, bf16, tf32):
# 128-row query tiles feed wgmma (a warpgroup of 4 warps takes 64 rows); 64-row tiles give
# more programs when B*H*Sq is small. The four kept are those that won on the H200 (bf16
# D=64 causal S=8192/16384, D=128 S=4096, fp32-tf32 S=4096, each config timed alone with
# `fusedattn bench --configs`); 128x64 with 4 warps (3 or 4 stages), 64x128 and 64x64 with
# 4 stages never did and went. fp32-ieee runs tl.dot as FMA on CUDA cores, where a thread's
# share of the tile sets the shared-memory traffic per FMA: it tries both sets (at S=4096,
# D=64 the FMA set alone reached 12.3 TFLOP/s). Short queries (bucket <= 256) try only
# small tiles: there one 128-row tile would be the whole grid of a head, and compiling
# fewer configs keeps a fresh process's first call short.
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
    comes divided by ALIGN: `_flash_fwd`)."""
    args = {**named_args, **kwargs}
    return candidates(configs, args["head_dim"] * args.get("ALIGN", 1), args["bucket_q"],
                      args["PRECISION"])
