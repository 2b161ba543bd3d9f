"""Selection overhead of d3s.py: how much do PODS / D3S down-sampling cost next to one sort?

    python bench/selection.py                 # default sizes (minutes on a laptop CPU)
    python bench/selection.py --quick         # small sizes, < 20 s (the smoke test runs this)
    python bench/selection.py --device cuda   # on a GPU, with torch.cuda.synchronize() around timings
    python bench/selection.py --out bench.md  # also write the tables to a file

Three tables, each a median over repeats (after a warm-up call) of the wall time of one call:

1. Sample level, rewards [P, G] (P prompts x G rollouts), keeping m = keep_frac * G per group:
   max_variance_subset and select_samples (one method per sample rule of methods.LADDER) against the floor of
   one torch.sort of the same [P, G] data, and against a straightforward Python reference (the
   PODS algorithm as written in the paper: per group, sort, then try every k in 0..m and
   compute the variance of "k largest + (m-k) smallest" directly). Cross-group "d3s" is one
   max_variance_subset over all P*G advantages, so it is compared to one sort of P*G values.
2. Token level: select_tokens on scores [B, T] (k_frac of the valid tokens, scope "batch" and
   "sequence") against one torch.sort (and topk) of the same data.
3. token_entropy (chunked) on [N, V] logits against the full-softmax one-liner
   -(softmax(z.float()) * log_softmax(z.float())).sum(-1): time, throughput, extrapolation to
   1M tokens, and the peak extra memory of each.

"x sort" is the median time divided by the median time of the floor named in the same table.
No assertions here: the tests only check that this script runs. On a machine shared with other
jobs, --threads 1 gives steadier numbers (intra-op threads stall when a core is taken).
"""

import argparse
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from support import cli  # noqa: E402  (support/cli.py: one-line errors, the shared checks)
import d3s  # noqa: E402
from support import methods  # noqa: E402

DEFAULT_SIZES = "64x8,256x16,1024x32,4096x64"
QUICK_SIZES = "64x8,256x16"
DEFAULT_TOKEN_SIZES = "64x1024,256x2048,512x2048"  # the last one is 1M tokens
QUICK_TOKEN_SIZES = "64x256,128x512"
DEFAULT_ENTROPY_TOKENS = "4096,16384,65536"  # 65536 x 32k bf16 = 4 GiB of logits
QUICK_ENTROPY_TOKENS = "64,256"


# ---------------------------------------------------------------------------------------------
# The Python reference: PODS max-variance down-sampling, the loop over k as in the paper
# ---------------------------------------------------------------------------------------------
def python_max_variance_subset(rows, m, deadline=None):
    """Plain-Python PODS: per row, sort, try k = 0..m, compute each candidate's variance directly.

    rows: list of lists of floats (one list per group);  returns a list of ascending index
    lists, m per row. Candidate k keeps the k largest and the m-k smallest values; its
    unbiased variance is computed from scratch (no prefix sums), so a row costs O(n log n + m^2).
    Raises TimeoutError once time.perf_counter() passes `deadline` (used to cap the benchmark).
    """
    out = []
    for row in rows:
        n = len(row)
        if not 1 <= m <= n:
            raise ValueError(f"m={m} must be in [1, n={n}]")
        order = sorted(range(n), key=row.__getitem__)  # ascending by value
        best_var, best = -math.inf, None
        for k in range(m + 1):  # k largest + (m - k) smallest
            cand = order[: m - k] + order[n - k :]
            vals = [row[i] for i in cand]
            mean = sum(vals) / m
            var = sum((x - mean) ** 2 for x in vals) / max(m - 1, 1)
            if var > best_var:
                best_var, best = var, cand
            if deadline is not None and time.perf_counter() > deadline:
                raise TimeoutError
        out.append(sorted(best))
    return out


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------
def make_sync(device):
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def median_time(fn, sync, repeats, min_run_s, budget_s=math.inf):
    """Median seconds per call of fn(), timeit-style.

    One warm-up call (also used to size the runs), then `repeats` runs of `number` calls each,
    `number` chosen so one run lasts about min_run_s. If the warm-up shows that the repeats
    would take longer than budget_s, fewer repeats are made (at least one besides the warm-up,
    unless the warm-up alone used the budget; then the warm-up time is returned).
    """
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    first = time.perf_counter() - t0
    if first >= budget_s:
        return first
    number = max(1, int(min_run_s / max(first, 1e-9)))
    reps = max(1, min(repeats, int(budget_s / max(first * number, 1e-9))))
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        sync()
        times.append((time.perf_counter() - t0) / number)
    return statistics.median(times)


def fmt_time(s):
    if s is None:
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:.1f} us"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.2f} s"


def fmt_ratio(t, floor):
    return "-" if t is None or not floor else f"{t / floor:.2f}x"


def md_table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def parse_sizes(text):
    out = []
    for part in text.split(","):
        a, b = part.lower().split("x")
        out.append((int(a), int(b)))
    return out


# ---------------------------------------------------------------------------------------------
# 1. Sample level
# ---------------------------------------------------------------------------------------------
def make_rewards(P, G, kind, device, gen):
    if kind == "binary":  # outcome rewards: each prompt has its own success rate
        p = torch.rand(P, 1, generator=gen)
        r = (torch.rand(P, G, generator=gen) < p).float()
    else:
        r = torch.rand(P, G, generator=gen)
    return r.to(device)


def bench_samples(args, device, sync, summary):
    rows = []
    gen = torch.Generator().manual_seed(args.seed)
    tm = lambda fn, budget=args.budget: median_time(fn, sync, args.repeats, args.min_run, budget)
    for P, G in parse_sizes(args.sizes):
        m = max(1, min(G, round(args.keep_frac * G)))
        r = make_rewards(P, G, args.rewards, device, gen)
        adv = d3s.group_advantages(r)
        flat = adv.reshape(-1)
        size = f"{P}x{G}, m={m}"

        floor = tm(lambda: torch.sort(r, dim=-1))
        rows.append([size, "torch.sort [P, G] (floor)", fmt_time(floor), "1.00x"])
        t = tm(lambda: d3s.group_advantages(r))
        rows.append([size, "group_advantages (part of every select_samples)", fmt_time(t), fmt_ratio(t, floor)])
        t = tm(lambda: d3s.max_variance_subset(r, m))
        rows.append([size, "max_variance_subset per group", fmt_time(t), fmt_ratio(t, floor)])
        summary["max_variance_subset per group"].append((t / floor, t))
        for method in (
            "grpo",
            "pods",
            "d3s-i",
            "random",
        ):  # one per per-group sample rule of methods.LADDER (d1s: as d3s-i)
            t = tm(lambda: d3s.select_samples(r, m, methods.LADDER[method].samples, generator=gen))
            rows.append([size, f"select_samples {method!r}", fmt_time(t), fmt_ratio(t, floor)])
            if method != "grpo":
                summary[f"select_samples {method!r}"].append((t / floor, t))
        t_ref = time_reference(r.cpu().tolist(), m, args)
        rows.append([size, "Python reference per group (loop over k)", ref_cell(t_ref), ref_ratio(t_ref, floor)])

        # Cross-group D3S: one choice of m*P out of all P*G advantages.
        floor_x = tm(lambda: torch.sort(flat))
        rows.append([size, "torch.sort [P*G] (floor, cross-group)", fmt_time(floor_x), "1.00x"])
        t = tm(lambda: d3s.max_variance_subset(flat, m * P))
        rows.append([size, "max_variance_subset [P*G], m*P (cross-group)", fmt_time(t), fmt_ratio(t, floor_x)])
        summary["max_variance_subset cross-group"].append((t / floor_x, t))
        t = tm(lambda: d3s.select_samples(r, m, "cross"))
        rows.append([size, "select_samples 'd3s' (cross-group)", fmt_time(t), fmt_ratio(t, floor_x)])
        summary["select_samples 'd3s' (cross-group)"].append((t / floor_x, t))
        t_ref = time_reference([flat.cpu().tolist()], m * P, args)
        rows.append([size, "Python reference cross-group (loop over k)", ref_cell(t_ref), ref_ratio(t_ref, floor_x)])
    return md_table(["P x G", "operation", "median", "x sort"], rows)


def time_reference(rows, m, args):
    """Median seconds of the Python reference on lists (conversion excluded), or ('skipped', cap)."""
    cap = args.ref_cap
    t0 = time.perf_counter()
    try:
        python_max_variance_subset(rows, m, deadline=t0 + cap)
    except TimeoutError:
        return ("skipped", cap)
    first = time.perf_counter() - t0
    if first * 3 > cap:  # slow: one run is the measurement
        return first
    return median_time(
        lambda: python_max_variance_subset(rows, m), lambda: None, args.repeats, args.min_run, budget_s=cap
    )


def ref_cell(t):
    return f"skipped (> {t[1]:g} s cap)" if isinstance(t, tuple) else fmt_time(t)


def ref_ratio(t, floor):
    return "-" if isinstance(t, tuple) else fmt_ratio(t, floor)


# ---------------------------------------------------------------------------------------------
# 2. Token level
# ---------------------------------------------------------------------------------------------
def bench_tokens(args, device, sync, summary):
    rows = []
    gen = torch.Generator().manual_seed(args.seed + 1)
    tm = lambda fn: median_time(fn, sync, args.repeats, args.min_run, args.budget)
    for B, T in parse_sizes(args.token_sizes):
        # score = |A_i| * H_{i,t}: one advantage per response, an entropy per token; right padding.
        A = torch.randn(B, 1, generator=gen).abs()
        H = torch.rand(B, T, generator=gen) * 3
        lengths = torch.randint(1, T + 1, (B, 1), generator=gen)
        mask = (torch.arange(T).unsqueeze(0) < lengths).to(device)
        scores = (A * H).to(device)
        k = math.ceil(args.k_frac * int(mask.sum()) - 1e-9)
        size = f"{B}x{T} ({B * T / 2**20:.2f}M tok)"

        floor_flat = tm(lambda: torch.sort(scores.reshape(-1)))
        rows.append([size, "torch.sort [B*T] (floor for scope='batch')", fmt_time(floor_flat), "1.00x"])
        t = tm(lambda: torch.topk(scores.reshape(-1), k))
        rows.append([size, f"torch.topk [B*T], k={k}", fmt_time(t), fmt_ratio(t, floor_flat)])
        t = tm(lambda: d3s.select_tokens(scores, mask, args.k_frac, scope="batch"))
        rows.append([size, f"select_tokens scope='batch', k_frac={args.k_frac}", fmt_time(t), fmt_ratio(t, floor_flat)])
        summary["select_tokens 'batch'"].append((t / floor_flat, t))

        floor_row = tm(lambda: torch.sort(scores, dim=-1))
        rows.append([size, "torch.sort [B, T] dim=-1 (floor for scope='sequence')", fmt_time(floor_row), "1.00x"])
        try:
            t = tm(lambda: d3s.select_tokens(scores, mask, args.k_frac, scope="sequence"))
        except Exception as e:  # report a broken d3s.py in the table instead of dying
            rows.append(
                [size, f"select_tokens scope='sequence', k_frac={args.k_frac}", f"error: {type(e).__name__}: {e}", "-"]
            )
            # Stand-in for the dominant cost, so the table still says what the scope costs:
            masked = torch.where(mask, scores, torch.full_like(scores, -math.inf))
            t = tm(lambda: masked.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1))
            rows.append(
                [
                    size,
                    "stand-in: the two argsorts of scope='sequence' (dim=-1 as keyword)",
                    fmt_time(t),
                    fmt_ratio(t, floor_row),
                ]
            )
        else:
            rows.append(
                [size, f"select_tokens scope='sequence', k_frac={args.k_frac}", fmt_time(t), fmt_ratio(t, floor_row)]
            )
            summary["select_tokens 'sequence'"].append((t / floor_row, t))
    return md_table(["B x T", "operation", "median", "x sort"], rows)


# ---------------------------------------------------------------------------------------------
# 3. Token entropy: time and peak memory, chunked vs full softmax
# ---------------------------------------------------------------------------------------------
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def full_softmax_entropy(z):
    """The straightforward entropy: materializes [N, V] fp32 softmax and log-softmax."""
    return -(torch.softmax(z.float(), -1) * torch.log_softmax(z.float(), -1)).sum(-1)


def make_logits(N, V, dtype, device, seed, fill_rows=1024):
    """[N, V] logits ~ 3 * randn, filled in row blocks so that making them needs no big temporary."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.empty(N, V, dtype=dtype, device=device)
    for s in range(0, N, fill_rows):
        z[s : s + fill_rows] = (torch.randn(min(fill_rows, N - s), V, generator=gen) * 3).to(dtype)
    return z


def mem_available_bytes():
    try:
        text = open("/proc/meminfo").read()
        return int(re.search(r"MemAvailable:\s+(\d+) kB", text).group(1)) * 1024
    except (OSError, AttributeError):
        return None


def full_need(N, V):
    return 3 * N * V * 4


def full_fits(N, V, device):
    """The full-softmax variant needs ~3 fp32 [N, V] tensors at once; run it only if that fits."""
    need = full_need(N, V)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return need < 0.7 * free
    avail = mem_available_bytes()
    return avail is None or need < 0.5 * avail


def _vm_kib(field):
    return int(re.search(rf"{field}:\s+(\d+) kB", open("/proc/self/status").read()).group(1))


def _entropy_fn(variant, z, chunk):
    if variant == "chunked":
        return lambda: d3s.token_entropy(z, chunk_size=chunk)
    return lambda: full_softmax_entropy(z)


def _reset_hwm():
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def mem_child(variants, N, V, dtype_name, chunk):
    """Runs in a fresh process (CPU): peak RSS growth while computing each entropy variant.

    Prints one JSON line {variant: extra_bytes, "hwm_reset": bool}. Without a resettable
    high-water mark only the first variant can be measured; the parent then starts another child.
    """
    z = make_logits(N, V, DTYPES[dtype_name], torch.device("cpu"), seed=0)
    for variant in variants:  # warm-up on a few rows: thread pools and kernels, no big buffers
        _entropy_fn(variant, z[:8], chunk)()
    result = {"hwm_reset": _reset_hwm()}
    for variant in variants if result["hwm_reset"] else variants[:1]:
        _reset_hwm()
        base = _vm_kib("VmRSS") if result["hwm_reset"] else _vm_kib("VmHWM")
        out = _entropy_fn(variant, z, chunk)()
        result[variant] = (_vm_kib("VmHWM") - base) * 1024
        del out
    print(json.dumps(result))


def peak_extra_memory(variants, N, V, dtype_name, chunk, device):
    """({variant: bytes}, how): the extra memory one call allocates beyond its input logits."""
    if device.type == "cuda":
        z = make_logits(N, V, DTYPES[dtype_name], device, seed=0)
        extra = {}
        for variant in variants:
            fn = _entropy_fn(variant, z, chunk)
            fn()
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            fn()
            torch.cuda.synchronize(device)
            extra[variant] = torch.cuda.max_memory_allocated(device) - base
        del z
        torch.cuda.empty_cache()
        return extra, "torch.cuda.max_memory_allocated() minus memory_allocated() before the call"
    extra, todo, reset = {}, list(variants), True
    while todo:
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--_mem-child",
            ",".join(todo),
            str(N),
            str(V),
            dtype_name,
            str(chunk),
        ]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
        if res.returncode != 0:
            raise RuntimeError(f"memory child failed: {res.stderr[-2000:]}")
        info = json.loads(res.stdout.strip().splitlines()[-1])
        reset = reset and info.pop("hwm_reset")
        extra.update(info)
        todo = [v for v in todo if v not in extra]
    how = (
        (
            "peak RSS growth in a fresh subprocess: /proc/self/status VmHWM after the call, minus VmRSS "
            "before it, with the high-water mark reset through /proc/self/clear_refs"
        )
        if reset
        else (
            "VmHWM growth in one fresh subprocess per variant (logits built in blocks, so the mark starts near the RSS)"
        )
    )
    return extra, how


def fmt_bytes(b):
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"


def bench_entropy(args, device, sync):
    V, dtype = args.vocab, DTYPES[args.logits_dtype]
    esize = torch.tensor([], dtype=dtype).element_size()
    rows, per_token = [], None
    for N in [int(x) for x in args.entropy_tokens.split(",")]:
        z = make_logits(N, V, dtype, device, seed=args.seed)
        t = median_time(
            lambda: d3s.token_entropy(z, chunk_size=args.chunk_size), sync, args.repeats, args.min_run, args.budget
        )
        per_token = t / N
        if full_fits(N, V, device):
            tf = median_time(lambda: full_softmax_entropy(z), sync, args.repeats, args.min_run, args.budget)
            full = fmt_time(tf)
        else:
            tf, full = None, f"skipped (needs ~{fmt_bytes(full_need(N, V))})"
        rows.append(
            [
                f"{N} x {V} {args.logits_dtype} ({fmt_bytes(N * V * esize)})",
                fmt_time(t),
                f"{per_token * 1e6:.2f} us",
                f"{N / t / 1e3:.1f}k",
                full,
                fmt_ratio(t, tf),
            ]
        )
        del z
    table = md_table(
        [
            "N tokens x V (logits size)",
            "token_entropy (chunked)",
            "per token",
            "tokens/s",
            "full softmax",
            "chunked / full",
        ],
        rows,
    )
    extrap = per_token * 2**20
    text = [
        table,
        "",
        f"Extrapolated to 1M (2^20) response tokens at V={V}: {fmt_time(extrap)} of token_entropy "
        f"(linear in N, from the largest size above). The [1M, {V}] logits themselves would be "
        f"{fmt_bytes(2**20 * V * esize)} in {args.logits_dtype} ({fmt_bytes(2**20 * V * 4)} in fp32), so they never exist at "
        "once: a training step forwards one micro-batch at a time and calls token_entropy on that "
        "micro-batch's logits, so the step pays this time spread over its micro-batches, next to "
        "the forward pass that produced the logits.",
        "",
    ]

    sweep = [int(c) for c in args.chunk_sweep.split(",") if c.strip()]
    if sweep:
        N = min(max(int(x) for x in args.entropy_tokens.split(",")), 8192)
        z = make_logits(N, V, dtype, device, seed=args.seed)
        srows = []
        for c in sweep:
            t = median_time(lambda: d3s.token_entropy(z, chunk_size=c), sync, args.repeats, args.min_run, args.budget)
            srows.append([str(c), fmt_bytes(c * V * 4), fmt_time(t), f"{t / N * 1e6:.2f} us", fmt_time(t / N * 2**20)])
        del z
        text += [
            f"token_entropy by chunk_size, on {N} x {V} {args.logits_dtype} logits:",
            "",
            md_table(
                ["chunk_size", "one fp32 [chunk, V] temporary", "median", "per token", "1M tokens (extrapolated)"],
                srows,
            ),
            "",
        ]

    N = args.mem_tokens
    variants = ["chunked"] + (["full"] if full_fits(N, V, device) else [])
    extra, how = peak_extra_memory(variants, N, V, args.logits_dtype, args.chunk_size, device)
    rows_c = min(N, args.chunk_size)
    mem_rows = [
        [
            "chunked (token_entropy)",
            fmt_bytes(extra["chunked"]),
            f"{extra['chunked'] / (rows_c * V * 4):.2f} x [{rows_c}, {V}]",
        ]
    ]
    if "full" in extra:
        mem_rows.append(["full softmax", fmt_bytes(extra["full"]), f"{extra['full'] / (N * V * 4):.2f} x [{N}, {V}]"])
    else:
        mem_rows.append(["full softmax", f"skipped (needs ~{fmt_bytes(full_need(N, V))})", "-"])
    text += [
        f"Peak extra memory of one entropy call on {N} x {V} {args.logits_dtype} logits "
        f"({fmt_bytes(N * V * esize)}), chunk_size={args.chunk_size}:",
        "",
        md_table(["variant", "measured peak extra", "= fp32 tensors of shape"], mem_rows),
        "",
        f"Measured as: {how}. The chunked peak is a fixed number of fp32 [chunk_size, V] temporaries, "
        "the same for any N (so also for 1M tokens); the full-softmax peak grows with N "
        f"({fmt_bytes(extra.get('full', full_need(N, V)) / N * 2**20)} at 1M tokens, extrapolated).",
    ]
    return "\n".join(text)


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------
TABLES = ("samples", "tokens", "entropy")


def sizes(names, lows=(1, 1)):
    """An argparse type: comma-separated sizes like 64x8,256x16 (names: ("P", "G")), each part >= its low."""

    def parse(text):
        for part in (x.strip() for x in text.split(",")):
            m = re.fullmatch(r"(\d+)[xX](\d+)", part)
            if not m:
                raise argparse.ArgumentTypeError(
                    f"{text!r}: {part!r} is not {names[0]}x{names[1]}; pass comma-separated sizes, e.g. 64x8,256x16"
                )
            if int(m[1]) < lows[0] or int(m[2]) < lows[1]:
                raise argparse.ArgumentTypeError(
                    f"{text}: {part} needs {names[0]} >= {lows[0]} and {names[1]} >= {lows[1]}"
                )
        return text

    return parse


def build_parser():
    f, n, seconds = cli.flag, cli.number, cli.number(float, 0, low_open=True, what="a finite number of seconds > 0")
    frac = lambda of: n(float, 0, 1, low_open=True, what=f"a fraction of {of} in (0, 1]")
    flags = [
        f(
            "--quick",
            False,
            bool,
            f"small sizes that finish in seconds (samples {QUICK_SIZES}, tokens {QUICK_TOKEN_SIZES}, "
            f"entropy {QUICK_ENTROPY_TOKENS}); overrides the size flags",
        ),
        f("--device", "cpu", ["cpu", "cuda"], "torch device (cuda: timings synchronize)"),
        f("--sizes", DEFAULT_SIZES, sizes(("P", "G"), (1, 2)), "sample-level sizes, PxG (advantages need G >= 2)"),
        f("--keep-frac", 0.25, frac("each group"), "rollouts kept per group: m = round(keep_frac * G)"),
        f("--rewards", "binary", ["binary", "uniform"], "binary 0/1 with a per-prompt success rate, or uniform [0, 1)"),
        f("--token-sizes", DEFAULT_TOKEN_SIZES, sizes(("B", "T")), "select_tokens sizes, comma-separated BxT"),
        f("--k-frac", 0.2, frac("the tokens"), "fraction of valid tokens select_tokens keeps"),
        f("--entropy-tokens", DEFAULT_ENTROPY_TOKENS, None, "token counts N for token_entropy on [N, vocab] logits"),
        f("--vocab", 32768, n(int, 2, 2**24, what="an int in [2, 2^24]"), "vocabulary size V of the logits"),
        f("--logits-dtype", "bf16", list(DTYPES), "dtype of the logits"),
        f("--chunk-size", None, n(int, 1), "rows per token_entropy chunk (default: its own, 8 MiB of fp32 on CPU)"),
        f(
            "--chunk-sweep",
            "16,64,256,1024,4096",
            None,
            "chunk sizes to time at min(largest N, 8192) tokens ('': none)",
        ),
        f("--mem-tokens", 16384, n(int, 1), "N for the peak-memory comparison of token_entropy"),
        f("--repeats", 7, n(int, 1), "timed runs per measurement; the median is reported"),
        f("--min-run", 0.05, seconds, "seconds one timed run should last (calls per run are chosen to reach it)"),
        f("--budget", 20.0, seconds, "seconds at most per measurement; fewer repeats beyond it"),
        f("--ref-cap", 10.0, seconds, "seconds at most for the Python reference per size; 'skipped' beyond"),
        f("--step-seconds", None, seconds, "a training step's wall time: also report selection as a share of it"),
        f("--threads", None, n(int, 0, 1024), "torch.set_num_threads (default: torch's choice)"),
        f("--seed", 0, n(int, 0, 2**63 - 2, what="an int in [0, 2^63 - 1)"), "random seed for the synthetic data"),
        f("--skip", "", None, f"comma-separated tables to skip: {', '.join(TABLES)}"),
        f("--out", None, cli.out_file, "also write the markdown report to this file"),
        f("--_mem-child", None, None, argparse.SUPPRESS, nargs=5),
    ]
    return cli.parser("selection.py", __doc__.split("\n")[0], flags)


def parse_args(argv=None):
    """The flags, every one checked before any timing: one line `selection.py: error: --flag VALUE: ...`, exit 2."""
    p = build_parser()
    args = p.parse_args(argv)
    if args._mem_child:  # this script's own child process (peak_extra_memory): its arguments are the parent's
        return args
    cli.int_list(p, "--entropy-tokens", args.entropy_tokens, low=1, what="comma-separated token counts >= 1")
    what = "comma-separated chunk sizes >= 1 ('' to skip)"
    cli.int_list(p, "--chunk-sweep", args.chunk_sweep, low=1, what=what, allow_empty=True)
    unknown = [t for t in (x.strip() for x in args.skip.split(",")) if t and t not in TABLES]
    if unknown:
        p.error(f"--skip {args.skip}: {unknown[0]!r} is not a table; skip some of {', '.join(TABLES)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device; use --device cpu, or install torch's CUDA build")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args._mem_child:
        variants, N, V, dtype_name, chunk = args._mem_child
        return mem_child(variants.split(","), int(N), int(V), dtype_name, int(chunk))
    if args.quick:
        args.sizes, args.token_sizes, args.entropy_tokens = QUICK_SIZES, QUICK_TOKEN_SIZES, QUICK_ENTROPY_TOKENS
        args.mem_tokens, args.chunk_sweep = 256, "64"
        args.repeats, args.min_run, args.budget, args.ref_cap = 3, 0.01, 1.0, 1.0
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)  # checked in parse_args: cpu, or a CUDA device torch sees
    sync = make_sync(device)
    if args.chunk_size is None:  # d3s.token_entropy's default for this device and vocabulary
        args.chunk_size = max(1, (2**21 if device.type == "cpu" else 2**26) // args.vocab)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    summary = {
        k: []
        for k in (
            "max_variance_subset per group",
            "select_samples 'pods'",
            "select_samples 'd3s-i'",
            "select_samples 'random'",
            "max_variance_subset cross-group",
            "select_samples 'd3s' (cross-group)",
            "select_tokens 'batch'",
            "select_tokens 'sequence'",
        )
    }

    def emit(text):
        print(text, flush=True)
        report.append(text)

    report = []
    dev_name = (
        torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    )
    try:
        load = open("/proc/loadavg").read().split()[:3]
    except OSError:
        load = ["?"]
    emit("# d3s selection overhead\n")
    emit(
        f"torch {torch.__version__}, device {device} ({dev_name}), {torch.get_num_threads()} threads, "
        f"{os.cpu_count()} CPUs, load average {' '.join(load)}; median of up to {args.repeats} runs after a warm-up; "
        f"{time.strftime('%Y-%m-%d %H:%M')}\n"
    )
    if "samples" not in skip:
        emit(f"## Sample level: rewards [P, G] ({args.rewards}), m = round({args.keep_frac} * G) kept per group\n")
        emit(
            "Per-group rows are relative to one torch.sort of the [P, G] rewards; cross-group rows to one "
            "torch.sort of the P*G advantages. The Python reference runs on Python lists (tensor -> list "
            "conversion not timed).\n"
        )
        emit(bench_samples(args, device, sync, summary) + "\n")
    if "tokens" not in skip:
        emit(f"## Token level: select_tokens on scores [B, T], k_frac={args.k_frac}, random right padding\n")
        emit(bench_tokens(args, device, sync, summary) + "\n")
    if "entropy" not in skip:
        emit(f"## token_entropy: chunked (chunk_size={args.chunk_size}) vs full softmax\n")
        emit(bench_entropy(args, device, sync) + "\n")

    lines = ["## Target: selection within 3x of one sort\n"]
    header = [
        "operation",
        "x sort at the largest size",
        "within 3x there",
        "worst x sort over sizes",
        "time at the largest size",
    ]
    if args.step_seconds:
        header.append(f"% of a {args.step_seconds:g} s step")
    rows = []
    for name, r in summary.items():
        if r:
            (ratio, last), worst = r[-1], max(x[0] for x in r)
            row = [name, f"{ratio:.2f}x", "yes" if ratio <= 3 else "no", f"{worst:.2f}x", fmt_time(last)]
            if args.step_seconds:
                row.append(f"{100 * last / args.step_seconds:.3f}%")
            rows.append(row)
    if rows:
        lines.append(md_table(header, rows))
        lines.append(
            "\nAt small sizes a sort takes microseconds and the ratios mostly measure fixed per-call "
            "overhead (argument checks, a handful of small kernels); the largest size is the one "
            "the 3x target is about."
        )
    if not args.step_seconds:
        lines.append("\nPass --step-seconds (one training step of train_small.py) to compare with 1% of a step.")
    emit("\n".join(lines) + "\n")
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(report) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
