"""`qsa`: the workbench's command line. `qsa --help` lists what exists; each command's
`--help` is its documentation."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from qsa.presets import DEFAULT_PRESET, get_preset
from qsa.workbench.registry import OPS, REGISTRY

if TYPE_CHECKING:
    from qsa.workbench.ab import ABPoint

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="QSA Workbench: Triton kernels for QSA sparse attention, measured and tuned.")
console = Console()
err_console = Console(stderr=True, soft_wrap=True)  # one line per error, greppable


def _verbatim(text: str, style: str | None = None) -> None:
    """Text on stdout as it is, on one line: messages and summaries quote layouts, configs and
    shapes in brackets, which rich would otherwise take for markup and drop."""
    console.print(escape(text), style=style, soft_wrap=True, highlight=False)


def _problem(text: str) -> None:
    """A refusal or failure, in red."""
    _verbatim(text, "red")


_OPTIONS = {"verbose": False, "interpreter": False}
# Errors a user can cause and fix (a bad value, shape, format, config, file or page set): one
# line naming the problem, exit 2. Anything else is a bug and keeps its traceback.
USER_ERRORS = (ValueError, OSError)


def _kernels_start() -> None:
    """Called by the commands that run kernels, as they start: the interpreter note is for
    runs, not for `--help` pages (click parses a subcommand's `--help` after the callback)."""
    if _OPTIONS["interpreter"]:
        logging.getLogger("qsa").info("no GPU: kernels run under the Triton interpreter "
                                      "(functional only; times mean nothing)")


@app.callback()
def _setup(ctx: typer.Context,
           verbose: bool = typer.Option(False, "--verbose", "-v",
                                        help="debug logging, and tracebacks for errors"),
           figure_formats: Optional[str] = typer.Option(
               None, "--figure-formats", help="formats of the figures written, e.g. "
               "png,svg,pdf (default png)")) -> None:
    """Runs before every command: logging, the figure formats, and the Triton interpreter on a
    machine without a GPU (kernels then run on the CPU; every timing is labelled functional
    only)."""
    _OPTIONS["verbose"] = verbose
    if figure_formats is not None:
        from qsa.workbench.plots import FORMATS_ENV, figure_formats as checked

        os.environ[FORMATS_ENV] = figure_formats
        try:
            checked()
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--figure-formats") from None
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    if os.environ.get("TRITON_INTERPRET", "0") != "1" and "triton.language" not in sys.modules:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
            _OPTIONS["interpreter"] = True


def main() -> None:
    """The `qsa` entry point: a user error (bad value, shape, format, config, file, page set)
    prints one line and exits 2; `--verbose` shows its traceback. Usage errors are click's
    (exit 2); anything else is a bug and keeps its traceback."""
    try:
        app()
    except USER_ERRORS as e:
        if _OPTIONS["verbose"]:
            raise
        err_console.print(f"[red]error:[/] {escape(str(e))}", highlight=False)
        err_console.print("(run with --verbose for the traceback)", style="dim")
        sys.exit(2)


PRESET_OPT = typer.Option(DEFAULT_PRESET, "--preset", help="Model preset name.")
OP_HELP = "; ".join(f"{s.name} ({s.summary})" for s in REGISTRY)  # every op of the registry


def _cell(v: object) -> str:
    """A table cell: counts as integers (a column with a gap is float: 16384.0, not
    1.638e+04), other floats to 4 significant digits."""
    if isinstance(v, float):
        return str(int(v)) if v.is_integer() and abs(v) < 1e15 else f"{v:.4g}"
    return str(v)


def _print_frame(df, title: str) -> None:
    from rich.measure import Measurement

    table = Table(title=title)
    for c in df.columns:
        table.add_column(str(c))
    for row in df.itertuples(index=False):
        table.add_row(*[_cell(v) for v in row])
    # Piped or redirected, rich assumes 80 columns and would cut the table: give it its width.
    out = console if console.is_terminal else Console(width=Measurement.get(
        console, console.options.update_width(1 << 14), table).maximum)
    out.print(table)


def _draw_figures(directory: Path) -> None:
    """The run's figures under `<run>/figures` (its results are stored already: a figure that
    fails is reported, not fatal)."""
    from qsa.workbench.plots import figures_for_run

    try:
        paths = figures_for_run(directory)
    except Exception as e:  # noqa: BLE001 - the measurement is safe; say what the figure lacked
        logging.getLogger("qsa").warning("figures of %s not drawn: %s: %s", directory, type(e).__name__, e)
        return
    if paths:
        console.print(f"figures: {len(paths)} files in {directory / 'figures'}")


@app.command()
def info() -> None:
    """Show the device, its FP8 flavour, measured ceilings (if cached) and the presets."""
    from qsa.measure.device import detect_device
    from qsa.presets import PRESETS

    dev = detect_device()
    console.print_json(json.dumps(dev.as_record(), default=str))
    for p in PRESETS.values():
        console.print(f"[bold]{p.name}[/]: {json.dumps(p.as_dict())}")


@app.command()
def presets() -> None:
    """List the model presets and their derived quantities."""
    from qsa.presets import PRESETS

    for p in PRESETS.values():
        console.print(f"[bold]{p.name}[/] QSA layers {list(p.qsa_layers)}, GQA group "
                      f"{p.gqa_group}, verify rows {p.rows_per_verify}, budget {p.token_budget}")


@app.command()
def ceilings(out: Path = typer.Option(Path("profiles"), help="profiles root"),
             measure: bool = typer.Option(False, "--measure", help="measure now and store "
                                          "under <out>/<device>/ceilings.json (to commit)")
             ) -> None:
    """Copy bandwidth and matrix rates of this device: the committed ones, or measured."""
    from qsa.measure.device import detect_device, load_or_measure_ceilings, measure_ceilings
    from qsa.measure.files import atomic_write_bytes

    dev = detect_device()
    if not dev.is_gpu:
        console.print("[yellow]no GPU: ceilings are only measured on a device[/]")
        raise typer.Exit(0)
    if measure:
        c = measure_ceilings(dev)
        path = out / dev.slug / "ceilings.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, c.to_json().encode())
        console.print(f"stored {path}")
    else:
        c = load_or_measure_ceilings(dev, profiles_root=out)
    console.print_json(c.to_json())


def _ints(s: str) -> list[int]:
    """"1,8,32" or "8K,128K" (K = 1024) as integers."""
    out = []
    for x in (t.strip() for t in s.split(",") if t.strip()):
        try:
            out.append(int(x[:-1]) * 1024 if x.upper().endswith("K") else int(x))
        except ValueError:
            raise typer.BadParameter(f"{x!r} is not an integer or a count like 32K") from None
    if not out:
        raise typer.BadParameter(f"{s!r} holds no values")
    return out


def _overlaps(s: str) -> list[float]:
    """"0,0.9": target mean Jaccards of neighbouring rows' selections, each in [0, 1)."""
    from qsa.overlap import OverlapError, check_target

    out = []
    for x in _strs(s):
        try:
            out.append(check_target(float(x)))
        except ValueError as e:
            msg = str(e) if isinstance(e, OverlapError) else f"overlap: {x!r} is not a number"
            raise typer.BadParameter(msg) from None
    if not out:
        raise typer.BadParameter(f"{s!r} holds no overlap values")
    return out


OVERLAP_HELP = ("target mean Jaccard of neighbouring rows' selections, comma-separated (0: "
                "independent rows; the real model's prefill rows measure about 0.9, "
                "vLLM RFC #55394)")


def _inputs_note(rec: dict) -> str:
    """What a point's inputs measured and which sparse GQA path ran, for its printed line."""
    parts = []
    if rec.get("overlap_measured") is not None:
        parts.append(f"measured overlap {rec['overlap_measured']:.2f}")
    if rec.get("path"):
        parts.append(f"{rec['path']}, union {rec['union_ratio']:.2f} rows")
    return f" ({'; '.join(parts)})" if parts else ""


def _one_int(s: str) -> int:
    """A single value such as "32K" (commands that run one shape)."""
    vals = _ints(s)
    if len(vals) != 1:
        raise typer.BadParameter(f"{s!r}: this command takes one value, got {len(vals)}")
    return vals[0]


def _env(s: str) -> dict[str, str]:
    """"NAME=VALUE,NAME=VALUE" as a dict; entries without '=' are refused by name."""
    out = {}
    for item in _strs(s):
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise typer.BadParameter(f"{item!r} is not NAME=VALUE")
        out[name] = value
    return out


def _strs(s: str) -> list[str]:
    return [x for x in s.split(",") if x]


@app.command()
def bench(op: str = typer.Option(OPS[0], help="op(s), comma-separated: " + OP_HELP),
          batch: str = typer.Option("1,8", help="batch sizes, comma-separated"),
          context: str = typer.Option("8K", help="contexts, e.g. 8K,32K,128K"),
          rows: str = typer.Option("4", help="query rows per request"),
          index_format: str = typer.Option("bf16", help="bf16,fp8,mxfp4"),
          kv_format: str = typer.Option("bf16", help="bf16,fp8"),
          preset: str = PRESET_OPT,
          env: str = typer.Option("", help="environment toggles for the run, e.g. "
                                  "QSA_STACKED_DECODE_SCORER=0"),
          selection: str = typer.Option("index", help="sparse GQA: token selections from the "
                                        "index path, or random (no index path)"),
          overlap: str = typer.Option("0", help=OVERLAP_HELP),
          sharing: str = typer.Option("auto", help="sparse GQA, comma-separated: auto (per "
                                      "call, from the measured union), per-row, shared"),
          trace: Optional[Path] = typer.Option(None, help="sparse GQA: replay this selection "
                                               "trace's requests and selections (docs/traces.md); "
                                               "replaces --batch, --context, --rows"),
          trace_layer: Optional[int] = typer.Option(None, help="--trace: the layer replayed "
                                                    "(default: its first)"),
          out: Path = typer.Option(Path("profiles"), help="results store root"),
          suite: Optional[str] = typer.Option(
              None, help="run a named suite instead of the grid options: headline, decode, "
                         "attention, prefill, smoke (qsa/workbench/suites/), or a YAML path"),
          verify_only: bool = typer.Option(
              False, help="--suite: verify every point on one input set, time nothing (quick "
                          "checks; runs under compute-sanitizer)")
          ) -> None:
    """Verify and time a grid of points (every product of the lists), or a named suite with
    its targets; one results-store run."""
    import itertools

    from tqdm.auto import tqdm

    from qsa.formats import check_index_format, check_kv_format
    from qsa.measure.results import start_run
    from qsa.workbench.ops import Point, VerificationError, measure

    if suite is not None:
        _bench_suite(suite, out, verify_only)
        return

    p = get_preset(preset)  # an unknown preset is a user error, before any point runs
    envd = _env(env)
    shape = (_ints(batch), _ints(context), _ints(rows))
    if trace is not None:
        from qsa.trace import read_trace

        t = read_trace(trace, p)
        t.layer_at(trace_layer)
        shape = ([int(t.context_lens.numel())], [int(t.context_lens.max())],
                 [max(t.rows_per_request)])
        selection = "trace"
    grid = list(itertools.product(_strs(op), *shape, _strs(index_format), _strs(kv_format),
                                  _overlaps(overlap), _strs(sharing)))
    for o, b, c, r, fi, fk, ov, sh in grid:  # a bad point: refused before a run opens
        Point(o, p, b, c, r, check_index_format(fi), check_kv_format(fk), selection=selection,
              overlap=ov, sharing=sh, trace=None if trace is None else str(trace),
              trace_layer=trace_layer)
    _kernels_start()
    failed = 0
    with start_run("bench", root=out, extra={"env": envd, "grid": len(grid)}) as run:
        for o, b, c, r, fi, fk, ov, sh in tqdm(grid, desc="bench", unit="pt"):
            what = f"{o} b{b} c{c} r{r} {fi}/{fk} overlap {ov:g}" + (
                f" {sh}" if sh != "auto" else "")
            try:
                rec = measure(o, preset=preset, batch=b, context=c, rows=r, index_format=fi,
                              kv_format=fk, env=envd, selection=selection, overlap=ov,
                              sharing=sh, trace=None if trace is None else str(trace),
                              trace_layer=trace_layer)
            except (VerificationError, ValueError, RuntimeError) as e:
                failed += 1
                _problem(f"{what}: {e}")
                continue
            run.add(rec)
            bw = rec.get("pct_bandwidth")
            console.print(f"{what}{_inputs_note(rec)}: {rec['us']:.2f} µs"
                          f"{f', {bw:.0f}% of copy bw' if bw is not None else ''} "
                          f"({rec['method']}{', functional only' if rec['functional_only'] else ''})")
    console.print(f"results: {run.directory}  ({len(grid) - failed} verified, {failed} failed)")
    _draw_figures(run.directory)
    if failed:
        raise typer.Exit(1)



def _bench_suite(name: str, out: Path, verify_only: bool = False) -> None:
    from qsa.workbench.suites import SuiteError, load_suite, run_suite

    try:
        s = load_suite(name)
    except (SuiteError, OSError) as e:
        raise typer.BadParameter(str(e), param_hint="--suite") from None
    _kernels_start()
    console.print(f"suite {s.name}: {len(s.points)} points, {len(s.steps)} steps "
                  f"({s.description})")

    def show(rec: dict) -> None:
        what = " ".join(f"{k}={rec[k]}" for k in ("op", "kernel", "batch", "context", "rows",
                                                  "index_format", "kv_format", "selection")
                        if rec.get(k) is not None and not (k == "kernel" and "op" in rec))
        if not rec.get("verified"):
            _problem(f"{what}: {rec.get('error')}")
        elif rec.get("us") is None and rec["record"] == "point":
            console.print(f"{what}: verified")
        elif rec["record"] == "step":
            console.print(f"step {what}: {rec['us_per_step']:.1f} µs per step (summed)")
        else:
            bw = rec.get("pct_bandwidth")
            console.print(f"{what}: {rec['us']:.2f} µs"
                          f"{f', {bw:.0f}% of copy bw' if bw is not None else ''}"
                          f"{' (functional only)' if rec.get('functional_only') else ''}")

    directory, targets = run_suite(s, out, on_row=show, verify_only=verify_only)
    import pandas as pd

    if targets:
        _print_frame(pd.DataFrame(targets)[["target", "goal", "direction", "value", "met",
                                            "miss_pct"]], f"targets of suite {s.name}")
    console.print(f"results: {directory}")
    bad = [t for t in targets if t["value"] is None]
    if bad:
        console.print(f"[red]{len(bad)} target(s) had no matching verified row[/]")


def _format_pairs(s: str) -> list[tuple[str, str]]:
    from qsa.formats import FormatError, format_pairs

    try:
        return format_pairs(s)
    except FormatError as e:
        raise typer.BadParameter(str(e)) from None


@app.command()
def step(preset: str = PRESET_OPT,
         phase: str = typer.Option("decode", help="decode (one step of MTP verify and draft "
                                   "calls) or prefill (one chunk of --rows rows per request)"),
         batch: Optional[int] = typer.Option(None, help="requests in the step (default: 8 for "
                                             "decode, 1 for prefill)"),
         context: str = typer.Option("32K", help="context per request, e.g. 32K (for prefill "
                                     "the chunk's last position + 1)"),
         rows: Optional[int] = typer.Option(None, help="prefill: rows (new tokens) of the "
                                            "chunk per request"),
         mtp: Optional[int] = typer.Option(None, help="MTP draft tokens (verify rows = mtp + 1); "
                                           "default: the preset's"),
         index_format: str = typer.Option("bf16", help="target index format"),
         kv_format: str = typer.Option("bf16", help="target KV format"),
         formats: Optional[str] = typer.Option(
             None, help="several INDEX/KV pairs side by side in one run, e.g. "
                        "bf16/bf16,fp8/fp8,mxfp4/fp8 (overrides --index-format/--kv-format); "
                        "speedups are against the first"),
         overlap: str = typer.Option("0", help=OVERLAP_HELP + "; each pair at each"),
         trace: Optional[Path] = typer.Option(None, help="a uniform selection trace whose "
                                              "selections the target layers' sparse GQA "
                                              "replays; sets --batch, --context and the rows"),
         out: Path = typer.Option(Path("profiles"), help="results store root")) -> None:
    """Per-step µs of every QSA kernel (decode: target verify + draft calls; prefill: one
    chunk through every QSA layer): sum and graph replay."""
    from qsa.measure.results import start_run
    from qsa.workbench.step import step_breakdowns, step_comparison

    ctx = _one_int(context)
    if batch is None:
        batch = 1 if phase == "prefill" else 8
    if mtp is None:
        mtp = get_preset(preset).mtp_draft_tokens
    pairs = _format_pairs(formats) if formats else [(index_format, kv_format)]
    overlaps = _overlaps(overlap)
    if trace is not None:
        from qsa.workbench.step import trace_shape

        if overlaps != [0.0]:
            raise typer.BadParameter("--overlap: a trace's selections overlap as recorded")
        batch, ctx, trace_rows = trace_shape(str(trace), get_preset(preset))
        if phase == "prefill":
            rows = trace_rows
        elif trace_rows != mtp + 1:
            raise typer.BadParameter(f"--trace: {trace_rows} rows per request; a decode step "
                                     f"with MTP {mtp} verifies {mtp + 1}")
    what = (f"prefill chunk of {rows} rows" if phase == "prefill" else "decode step")
    frames = []
    _kernels_start()
    try:
        for df in step_breakdowns(preset, batch, ctx, mtp, pairs, progress=True, phase=phase,
                                  rows=rows, overlaps=overlaps,
                                  trace=None if trace is None else str(trace)):
            _print_frame(df[["phase", "kernel", "rows", "calls_per_step", "us_per_call",
                             "us_per_step", "share", "method", "overlap_measured", "path"]],
                         f"{preset} {what}: batch {batch} x {ctx}, MTP {mtp}, index "
                         f"{df['index_format'].iloc[0]}, KV {df['kv_format'].iloc[0]}, "
                         f"overlap {df['overlap_target'].iloc[0]:g}")
            frames.append(df)
    except ValueError as e:  # a bad phase, rows, shape or format, named by the message
        raise typer.BadParameter(str(e)) from None
    with start_run("step", root=out, extra={"preset": preset, "batch": batch, "context": ctx,
                                            "mtp": mtp, "formats": pairs, "step_phase": phase,
                                            "rows": rows, "overlaps": overlaps,
                                            "trace": None if trace is None else str(trace)}
                   ) as run:
        for df in frames:
            run.add_many({**r, "preset": preset, "batch": batch, "context": ctx, "mtp": mtp,
                          "chunk_rows": rows} for r in df.to_dict("records"))
        if len(frames) > 1:
            from qsa.measure.device import detect_device

            # Drawn under figures/, where the run's figures (below) redraw it with the
            # device, versions and method in the caption.
            cmp = step_comparison(frames, run.directory / "figures" / "step_formats.png",
                                  f"{preset}: {what}, batch {batch} x {ctx}, MTP {mtp}; "
                                  f"{detect_device().name}, graph replay per kernel, cold L2")
            _print_frame(cmp, "step side by side (speedup against the first pair)")
    console.print(f"results: {run.directory}")
    _draw_figures(run.directory)


def _candidates(text: Optional[str]) -> Optional[list[dict]]:
    """`--candidates`: a JSON list of config changes, given inline or as a file's path."""
    if text is None:
        return None
    where = "inline JSON"
    source = text
    if not text.lstrip().startswith(("[", "{")):  # not inline JSON: a file's path
        where = f"file {text}"
        try:
            source = Path(text).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise typer.BadParameter(f"--candidates: {text!r} is neither inline JSON nor a "
                                     f"readable file ({e})") from None
    try:
        value = json.loads(source)
    except json.JSONDecodeError as e:
        raise typer.BadParameter(f"--candidates: {where} is not valid JSON ({e})") from None
    if not isinstance(value, list) or not all(isinstance(c, dict) for c in value):
        raise typer.BadParameter("--candidates: expected a JSON list of objects such as "
                                 '{"meta": {"BLOCK_N": 64}, "num_warps": 8}')
    return value


@app.command()
def tune(op: Optional[Literal[OPS]] = typer.Argument(None, help="op to tune: " + OP_HELP),
         all_: bool = typer.Option(False, "--all", help="every kernel call of the decode step "
                                   "(--batch x --context, MTP --mtp) or of one prefill chunk "
                                   "(--phase prefill) for each --formats pair; each distinct "
                                   "config coordinate once, resumable"),
         phase: str = typer.Option("decode", help="--all: decode (the step's verify and draft "
                                   "calls) or prefill (one chunk of --rows rows per request)"),
         preset: str = PRESET_OPT,
         batch: Optional[int] = typer.Option(None, help="requests (default: 1 for --all "
                                             "--phase prefill, else 8)"),
         context: str = "32K", rows: int = 4,
         index_format: str = "bf16", kv_format: str = "bf16",
         mtp: Optional[int] = typer.Option(None, help="--all: MTP draft tokens (default: the "
                                           "preset's)"),
         formats: str = typer.Option("bf16/bf16,fp8/fp8,mxfp4/fp8",
                                     help="--all: INDEX/KV pairs of the steps to cover"),
         force: bool = typer.Option(False, help="--all: tune coordinates already tuned on "
                                    "this device too"),
         max_candidates: int = typer.Option(48, help="cap on the candidates timed"),
         write: bool = typer.Option(False, help="store the winner in the config table"),
         selection: str = typer.Option("index", help="sparse GQA: token selections from "
                                       "the index path, or random (no index path)"),
         overlap: float = typer.Option(0.0, help="target mean Jaccard of neighbouring rows' "
                                       "selections (0: independent rows)"),
         backend: str = typer.Option("local", help="--all: local (this GPU) or ray (each "
                                     "shape's candidates as one task on one GPU of a Ray "
                                     "cluster)"),
         address: Optional[str] = typer.Option(None, help="ray: the cluster (auto, "
                                               "ray://HOST:PORT, local)"),
         candidates: Optional[str] = typer.Option(
             None, help='changes to the current entry to try instead of the derived space: a '
             'JSON list, inline or in a file, e.g. \'[{"meta": {"SLOTS": 1}}, '
             '{"num_warps": 8}]\''),
         out: Path = typer.Option(Path("profiles"), help="results store root")) -> None:
    """Sweep the config space around the current entry; every candidate verified, then timed."""
    from qsa.measure.results import start_run
    from qsa.workbench.tune import tune as run_tune
    from qsa.workbench.tune import tune_all

    ctx = _one_int(context)
    if all_ == (op is not None):
        raise typer.BadParameter("give either an op or --all")
    if all_ and candidates is not None:
        raise typer.BadParameter("--candidates: one op's changes; --all derives each space")
    if phase != "decode" and not all_:
        raise typer.BadParameter("--phase: with --all only (one op takes --rows and --batch)")
    if write and os.environ.get("TRITON_INTERPRET") == "1":  # refused before the search
        raise ValueError("--write: no GPU, and interpreter timings are never written to a "
                         "config table; tune without --write here, or with it on a GPU")
    _kernels_start()
    if batch is None:
        batch = 1 if phase == "prefill" else 8
    if all_:
        from qsa.workbench.step import step_calls

        p = get_preset(preset)
        steps = mtp if mtp is not None else p.mtp_draft_tokens
        chunk = rows if phase == "prefill" else None  # --rows is a prefill chunk's only
        try:
            points = [c.point(p, batch, ctx, overlap) for pair in _format_pairs(formats)
                      for c in step_calls(p, steps, *pair, phase=phase, rows=chunk)]
        except ValueError as e:  # a bad phase or chunk, named by the message
            raise typer.BadParameter(str(e)) from None
        with start_run("tune-all", root=out, extra={"batch": batch, "context": ctx,
                                                     "mtp": steps, "formats": formats,
                                                     "step_phase": phase,
                                                     "chunk_rows": chunk}) as run:
            console.print(f"results (written as each shape is done): {run.directory}")

            def keep(row: dict) -> None:
                run.add(row)
                run.flush()

            if backend == "ray":
                from qsa.workbench.tune import tune_all_on_cluster

                df = tune_all_on_cluster(points, address or "auto",
                                         max_candidates=max_candidates, write=write,
                                         force=force, on_row=keep)
            elif backend == "local":
                df = tune_all(points, max_candidates=max_candidates, write=write, force=force,
                              on_row=keep)
            else:
                raise typer.BadParameter(f"backend: {backend!r} is not local or ray")
        cols = [c for c in ("op", "index_format", "kv_format", "rows", "fmt", "bucket",
                            "status", "current_us", "best_us", "gain", "noise_rel", "verdict")
                if c in df]
        what = f"prefill chunk calls of {chunk} rows" if chunk else "step calls"
        _print_frame(df[cols], f"tune --all: {len(points)} {what}, batch {batch} x {ctx}")
        return
    try:
        df = run_tune(op, preset=preset, batch=batch, context=ctx, rows=rows,
                      index_format=index_format, kv_format=kv_format,
                      max_candidates=max_candidates, write=write, selection=selection,
                      candidates=_candidates(candidates), overlap=overlap)
    except ValueError as e:  # a bad op, shape, format or selection, named by the message
        raise typer.BadParameter(str(e)) from None
    ok = df[df["status"] == "ok"].sort_values("us")
    _print_frame(ok[["candidate", "us", "p10_us", "p90_us", "config"]].head(10),
                 f"tune {op}: {len(ok)} of {len(df)} candidates verified")
    with start_run("tune", root=out, extra={"op": op}) as run:
        run.add_many(r for r in df.to_dict("records"))
    console.print(f"results: {run.directory}")
    _draw_figures(run.directory)


@app.command()
def capacity(gib: float = typer.Option(64.0, help="pool size in GiB"),
             out: Optional[Path] = typer.Option(None, help="also write CSV + markdown here")
             ) -> None:
    """Tokens that fit in the pool for every cache-format combination, and the ratio to BF16."""
    from qsa.arena.capacity import capacity_table

    df = capacity_table(gib=gib, out_dir=out)
    _print_frame(df[["preset", "draft", "kv", "index", "tokens", "ratio_vs_bf16"]],
                 f"tokens in {gib:g} GiB (draft: how the MTP draft layer is counted)")


@app.command("compile-check")
def compile_check(ctx: typer.Context,
                  arch: str = typer.Option("sm90,gfx950,gfx942",
                                           help="targets, comma-separated (sm90, gfx950, gfx942)"),
                  ops: Optional[str] = typer.Option(None, help="only these ops, comma-separated"),
                  out: Path = typer.Option(Path("profiles/compile/compile_check.csv"),
                                           help="the table of compiled kernels (CSV)"),
                  sass: bool = typer.Option(False, "--sass", help="also every kernel's opcode "
                                            "histogram (sm90: its SASS, and its main loop's; "
                                            "gfx9: the assembly's instructions), written with "
                                            "the table's rows to <out stem>.sass.json"),
                  diff: Optional[tuple[Path, Path]] = typer.Option(
                      None, "--diff", metavar="A B", help="compile nothing: per compiled kernel, "
                      "what moved from output A to output B (two revisions, say): registers, "
                      "spills, shared memory, instructions, top opcodes. Each a table, its "
                      ".sass.json or their folder")) -> None:
    """Compile every kernel with every config of its tables for GPUs that need not be here
    (on the CPU; no launch): registers, spills and shared memory per config, and with --sass
    opcode histograms. Exit 1 when a config does not compile or spills on its target. --diff
    compares two such outputs."""
    import subprocess

    from qsa.workbench.compile_check import TARGETS

    if diff is not None:
        given = [f"--{n}" for n in ("arch", "ops", "out", "sass")
                 if ctx.get_parameter_source(n).name == "COMMANDLINE"]
        if given:
            raise typer.BadParameter(f"--diff compiles nothing; drop {', '.join(given)}")
        _compile_diff(*diff)
        return
    archs = [a.strip() for a in arch.split(",") if a.strip()]
    bad = [a for a in archs if a not in TARGETS]
    if bad or not archs:
        raise typer.BadParameter(f"arch: {bad or arch!r} not among {', '.join(TARGETS)}")
    # Its own process, without TRITON_INTERPRET: the interpreter never compiles.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "qsa.workbench.compile_check", str(out), *archs]
    if ops:
        cmd += ["--ops", ops]
    if sass:
        cmd.append("--sass")
    raise typer.Exit(subprocess.run(cmd, env=env).returncode)


def _compile_diff(a: Path, b: Path) -> None:
    """`qsa compile-check --diff A B`: a count of each kind of change, and the kernels that
    moved, each count as A -> B."""
    from qsa.workbench.compile_check import diff_checks, read_rows

    df = diff_checks(read_rows(a), read_rows(b))
    counts = df["change"].value_counts()
    _verbatim(f"B = {b} against A = {a}: {len(df)} compiled kernels; "
              + " · ".join(f"{c} {int(counts.get(c, 0))}"
                           for c in ("changed", "same", "only in A", "only in B")))
    moved = df[df["change"] != "same"]
    if not len(moved):
        return
    table = moved[["arch", "op", "fmt", "bucket", "launch", "change", "config"]].copy()
    for col, name in (("registers", "registers"), ("spill_bytes", "spill bytes"),
                      ("shared_bytes", "shared bytes"), ("instructions", "instructions"),
                      ("loop_instructions", "loop instructions")):
        pairs = list(zip(moved[f"{col}_a"], moved[f"{col}_b"]))
        if any(x == x or y == y for x, y in pairs):  # NaN != NaN: a count neither side has
            table[name] = [_from_to(x, y) for x, y in pairs]
    table["top opcodes (B - A)"] = moved["opcodes"]
    table["kernel"] = moved["kernel"]
    _print_frame(table, "compiled kernels that moved (counts as A -> B)")


def _from_to(a: float, b: float) -> str:
    """"58 -> 64", "58" when equal, the one side's value alone, or "" for neither."""
    shown = [f"{v:g}" for v in (a, b) if v == v]  # NaN != NaN: a side without the count
    return " -> ".join(shown) if len(shown) == 2 and a != b else "".join(shown[:1])


@app.command("offload-check")
def offload_check(file: Optional[Path] = typer.Argument(
                      None, help="a page file to verify (on the CPU) instead of a round trip"),
                  kv_format: str = "fp8", index_format: str = "fp8", pages: int = 64,
                  preset: str = PRESET_OPT,
                  expect_layout: bool = typer.Option(
                      False, help="FILE: also require the layout of --preset, --kv-format and "
                                  "--index-format"),
                  save: Optional[Path] = typer.Option(
                      None, help="round trip: also write the stored set to this page file")
                  ) -> None:
    """Round trip: store pages to host memory, scramble the blocks, restore elsewhere, compare
    bytes. With FILE: check a page file's format, every page digest and its manifest; a file
    that can not be read or is refused is one line on stderr naming it and why, exit 2."""
    from qsa.arena import OffloadError, offload_roundtrip_check

    if file is not None:
        from qsa.arena import CacheFormats, PageLayout
        from qsa.arena.page_file import verify_page_file

        layout = (PageLayout.for_preset(get_preset(preset), CacheFormats(kv_format, index_format))
                  if expect_layout else None)
        try:
            r = verify_page_file(file, layout)
        except OffloadError as e:  # every refusal, an unreadable file included, names the file
            err_console.print(f"[red]refused:[/] {escape(str(e))}", highlight=False)
            raise typer.Exit(2)
        console.print_json(json.dumps({"ok": True, **r}))
        return
    if pages < 1:  # the round trip scales it; the user's value is the one to name
        raise ValueError(f"--pages: must be >= 1, got {pages}")
    _kernels_start()
    dev = "cuda" if __import__("torch").cuda.is_available() else "cpu"
    r = offload_roundtrip_check(dev, preset=preset, kv=kv_format, index=index_format,
                                pages=pages, save=save)
    console.print_json(json.dumps(r, default=str))
    if not r["ok"]:
        raise typer.Exit(1)


@app.command()
def profile(op: Literal[OPS] = typer.Option(OPS[0], help="op to capture: " + OP_HELP),
            preset: str = PRESET_OPT, batch: int = 8, context: str = "32K", rows: int = 4,
            index_format: str = "bf16", kv_format: str = "bf16",
            profiler: str = typer.Option("torch", help="torch | proton | rocprofv3"),
            steps: int = typer.Option(50, help="calls captured"),
            out: Path = typer.Option(Path("profiles"), help="results store root")) -> None:
    """Capture a verified point with a profiler and compare its per-kernel time with the
    timing module's; the trace lands in the run directory under `profiles/`."""
    from qsa.measure.results import start_run
    from qsa.workbench.profile import point_from_args, profile_point, run_roctx_steps

    point = point_from_args(op, preset, batch, _one_int(context), rows, index_format, kv_format)
    _kernels_start()
    if profiler == "roctx":  # the child process of a rocprofv3 capture
        run_roctx_steps(point, steps)
        return
    from qsa.profiling import ProfilerUnavailableError
    from qsa.profiling.rocprof import rocprofv3_capture_problem

    problem = rocprofv3_capture_problem() if profiler == "rocprofv3" else None
    if problem is not None:  # refused before a run is opened or anything is measured
        raise ValueError(f"profiler rocprofv3: {problem}")
    with start_run("profile", root=out, extra={"profiler": profiler, "steps": steps}) as run:
        try:
            rec = profile_point(point, profiler, run.directory / profiler, steps)
        except ProfilerUnavailableError as e:  # a missing tool is the user's to fix
            raise ValueError(f"profiler {profiler}: {e}") from None
        run.add({**point.as_record(), **rec, "profiler": profiler})
    console.print_json(json.dumps(rec, default=str))
    console.print(f"results and trace: {run.directory}")
    _draw_figures(run.directory)



@app.command()
def sweep(spec: Path = typer.Argument(..., help="sweep spec (YAML), e.g. sweeps/decode_scoring_cpu.yaml"),
          out: Path = typer.Option(Path("profiles"), help="results root"),
          jobs: Optional[int] = typer.Option(None, help="worker processes (default: one per GPU)"),
          resume: bool = typer.Option(True, help="skip points already done with the same code"),
          backend: str = typer.Option("local", help="local (this host's GPUs) or ray (a Ray "
                                      "cluster: one task per point, one GPU per task)"),
          address: Optional[str] = typer.Option(None, help="ray: the cluster, auto (this "
                                                "node's), ray://HOST:PORT, or local (start one "
                                                "here)")
          ) -> None:
    """Run a notebook sweep: one papermill process per point over the visible GPUs (or the
    GPUs of a Ray cluster), resumable."""
    from qsa.workbench.sweep import SweepError, SweepLocked, run_sweep

    try:
        summary = run_sweep(spec, out, jobs=jobs, resume=resume, backend=backend,
                            address=address)
    except (SweepLocked, SweepError) as e:
        _problem(str(e))
        raise typer.Exit(2)
    except KeyboardInterrupt:  # run_sweep recorded `interrupted` and printed how to resume
        raise typer.Exit(130)
    _verbatim(str(summary))
    raise typer.Exit(0 if summary.ok else 1)


@app.command()
def notebook(name: str = typer.Argument(..., help="a notebook of notebooks/ (e.g. "
                                        "step_breakdown) or a path to a .py/.ipynb notebook"),
             param: list[str] = typer.Option([], "--param", "-p",
                                             help="KEY=VALUE, repeatable; VALUE is YAML "
                                                  "(3, 8K is a string, [1, 8], gpu)"),
             out: Optional[Path] = typer.Option(None, help="executed notebook (.ipynb); "
                                                "default notebooks/executed/NAME.ipynb"),
             timeout_s: Optional[float] = typer.Option(None, help="per-cell timeout")) -> None:
    """Run a notebook (jupytext .py or .ipynb) with papermill and parameters, from the
    repository root; unknown parameter names and profile=gpu without a GPU are refused."""
    import yaml

    from papermill.exceptions import PapermillExecutionError

    from qsa.workbench.notebook_run import (NotebookError, cell_error, execute_notebook,
                                            notebook_parameters, notebook_path, results_lines)

    path = notebook_path(name)
    params = {}
    for item in param:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise typer.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="--param")
        params[key.strip()] = yaml.safe_load(value)
    known = notebook_parameters(path)
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise NotebookError(f"{path.name}: unknown parameters {unknown}; it takes "
                            f"{sorted(known)}")
    if params.get("profile") == "gpu" and os.environ.get("TRITON_INTERPRET") == "1":
        raise NotebookError("profile=gpu asked for, but this machine has no GPU (kernels run "
                            "under the Triton interpreter); use the notebook's CPU profile")
    root = Path(__file__).resolve().parents[1]
    target = out or root / "notebooks" / "executed" / f"{path.stem}.ipynb"
    try:
        nb = execute_notebook(path.resolve(), target, params, cwd=root, timeout_s=timeout_s,
                              progress=True)
    except PapermillExecutionError as e:  # one line; the executed notebook shows the rest
        _problem(f"{path.name}: {cell_error(e, target)}")
        raise typer.Exit(1)
    for line in results_lines(nb):
        _verbatim(line)
    console.print(f"executed: {target}")


@app.command("compare")
def compare_cmd(a: Path = typer.Argument(..., help="run A: a run folder (run.json) or a sweep "
                                         "folder (sweep.json)"),
                b: Path = typer.Argument(..., help="run B, likewise"),
                keys: Optional[str] = typer.Option(None, help="columns that identify a point, "
                                                   "comma-separated (default: the shape "
                                                   "columns both have)"),
                out: Optional[Path] = typer.Option(None, help="new folder for the table (CSV), "
                                                   "compare.json and the figure; default: "
                                                   "<root>/<device>/compare/<id>, never an "
                                                   "input's folder"),
                root: Path = typer.Option(Path("profiles"), help="results root of the default "
                                          "--out")) -> None:
    """A/B of two runs or sweeps, point by point, with a verdict from a bootstrap interval of
    each point's speedup (faster, slower, same within noise, incomparable), a summary, a CSV
    and a figure."""
    from qsa.workbench.compare import compare_runs, output_folder, write_comparison
    from qsa.workbench.plots import comparison_chart

    cmp, diff = compare_runs(a, b, keys=_strs(keys) if keys else None)
    folder = output_folder(out, root, cmp, (a, b))  # refused before anything is written
    _verbatim(cmp.summary())
    if diff:
        _verbatim(f"what differs: {json.dumps(diff, default=str)}")
    shown = cmp.table[cmp.table["verdict"] != "same"]
    if len(shown):
        varying = [k for k in cmp.keys if cmp.table[k].nunique(dropna=False) > 1]
        _print_frame(shown[[*varying, "us_a", "us_b", "speedup", "verdict"]],
                     "points that are not the same within noise")
    table = write_comparison(cmp, diff, folder, a, b)
    fig = comparison_chart(cmp, folder)
    console.print(f"table: {table}  figure: {fig.paths[0]}")


# Options of bench and step that an A/B does not take, and why.
AB_REFUSED = {"out": "give it to ab itself, before --: the A/B writes both sides' runs",
              "suite": "an A/B measures a grid (--op, --batch, ...), not a suite",
              "verify_only": "an A/B times its points"}


def _ab_points(args: list[str]) -> list[ABPoint]:
    """The points of `qsa ab -- bench ...` or `-- step ...`: the arguments parsed by that
    command's own options (so defaults and spellings are its), then expanded as it does."""
    from typer.main import get_command

    from qsa.workbench.ab import bench_points, step_points

    if not args or args[0] not in ("bench", "step"):
        got = repr(" ".join(args)) if args else "nothing"
        raise typer.BadParameter(f"after --, give bench or step and its arguments (e.g. -- bench "
                                 f"--op score_stacked); got {got}", param_hint="ARGS")
    ctx = get_command(app).commands[args[0]].make_context(args[0], args[1:])
    prm = ctx.params
    for name, instead in AB_REFUSED.items():
        if name in prm and ctx.get_parameter_source(name).name == "COMMANDLINE":
            raise typer.BadParameter(f"--{name.replace('_', '-')}: {instead}",
                                     param_hint="ARGS")
    p = get_preset(prm["preset"])
    trace = None if prm["trace"] is None else str(prm["trace"])
    try:
        if args[0] == "bench":
            return bench_points(p, _strs(prm["op"]), _ints(prm["batch"]), _ints(prm["context"]),
                                _ints(prm["rows"]), _strs(prm["index_format"]),
                                _strs(prm["kv_format"]), _overlaps(prm["overlap"]),
                                _strs(prm["sharing"]), selection=prm["selection"],
                                env=_env(prm["env"]), trace=trace,
                                trace_layer=prm["trace_layer"])
        phase = prm["phase"]
        return step_points(p, prm["batch"] or (1 if phase == "prefill" else 8),
                           _one_int(prm["context"]),
                           p.mtp_draft_tokens if prm["mtp"] is None else prm["mtp"],
                           _format_pairs(prm["formats"]) if prm["formats"]
                           else [(prm["index_format"], prm["kv_format"])],
                           _overlaps(prm["overlap"]), phase=phase, rows=prm["rows"], trace=trace)
    except ValueError as e:  # a bad shape, format or phase, named by the message
        raise typer.BadParameter(str(e), param_hint="ARGS") from None


@app.command()
def ab(base: str = typer.Option(..., help="revision measured as A: a commit, branch or tag "
                                "(HEAD~1, main)"),
       head: Optional[str] = typer.Option(None, help="revision measured as B (default: the "
                                          "working tree, uncommitted changes included and "
                                          "recorded)"),
       rounds: int = typer.Option(4, min=1, help="turns each side takes at every point, A "
                                  "first in even rounds, B first in odd ones"),
       out: Path = typer.Option(Path("profiles"), help="results store root: both runs, and "
                                "the comparison under <device>/compare/"),
       args: Optional[list[str]] = typer.Argument(
           None, metavar="-- bench|step ARGS", help="what both revisions measure, as `qsa "
           "bench` or `qsa step` takes it: a grid of points, or a step's kernel calls")) -> None:
    """A/B of two revisions on one device: each runs in its own process, importing its own
    `qsa/`, and they take turns at every point for several rounds, so drift reaches both
    alike; the two sides are stored as two runs (kind ab) and judged by `qsa compare`. Needs a
    GPU; exit 1 when a side fails a point."""
    from qsa.measure.device import detect_device
    from qsa.workbench.ab import ABError, SideFailed, checkout, resolve_revision, run_ab, step_sums

    points = _ab_points(args or [])
    repo = checkout()
    revisions = (resolve_revision(repo, base, "--base"), resolve_revision(repo, head, "--head"))
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise ABError("ab: no GPU; an A/B times both revisions on one device (interpreter "
                      "times say nothing of either)")
    _verbatim(f"A = {revisions[0].label}, B = {revisions[1].label}: {len(points)} points, "
              f"{rounds} rounds each")
    try:
        res = run_ab(points, revisions, repo=repo, rounds=rounds, root=out,
                     device=detect_device(), args=args, say=_verbatim)
    except SideFailed as e:
        _problem(str(e))
        raise typer.Exit(1)
    _verbatim(f"runs: A {res.runs[0]}, B {res.runs[1]}")
    for line in step_sums(points, res.records):
        _verbatim(line)
    if any(all(r is None for r in side) for side in res.records):
        _problem("a side measured no point: nothing to compare")
        raise typer.Exit(1)
    compare_cmd(*res.runs, keys=",".join(res.keys), out=None, root=out)
    if res.failures:
        raise typer.Exit(1)


@app.command()
def report(run_dir: Optional[Path] = typer.Argument(None, help="a stored run: print its tables"),
           readme: Optional[Path] = typer.Option(None, help="rewrite every results block of "
                                                 "this file from the run it names"),
           check: bool = typer.Option(False, help="--readme: change nothing, exit 1 when a "
                                      "block differs from its run")) -> None:
    """Markdown tables of a run (points by format, steps, targets), or the README's results
    blocks regenerated from their runs."""
    from qsa.workbench.report import run_tables, update_readme

    if (run_dir is None) == (readme is None):
        raise typer.BadParameter("give a run folder or --readme")
    if run_dir is not None:
        _verbatim(run_tables(run_dir))
        return
    text, changed = update_readme(readme)
    if check:
        if changed:
            _problem(f"{readme}: results blocks differ from their runs: {', '.join(changed)}")
            raise typer.Exit(1)
        return
    readme.write_text(text)
    console.print(f"{readme}: {len(changed)} block(s) regenerated")


trace_app = typer.Typer(no_args_is_help=True, help="Selection traces: check one, or write a "
                        "synthetic one (docs/traces.md).")
app.add_typer(trace_app, name="trace")


@trace_app.command("check")
def trace_check(file: Path = typer.Argument(..., help="a selection trace (.safetensors)"),
                preset: Optional[str] = typer.Option(None, "--preset", help="the preset it must "
                                                     "be for (default: the one it names)")
                ) -> None:
    """Validate a trace; print its rows, layers and measured overlap."""
    from qsa.trace import describe, read_trace

    console.print_json(json.dumps(describe(read_trace(file, preset)), default=str))


@trace_app.command("synth")
def trace_synth(out: Path = typer.Argument(..., help="the trace to write (.safetensors)"),
                overlap: float = typer.Option(..., help="target mean Jaccard of neighbouring "
                                              "rows' selections, in [0, 1)"),
                batch: int = 32, context: str = "32K",
                rows: int = typer.Option(4, help="rows per request (a verify step: MTP + 1)"),
                layers: int = typer.Option(1, help="QSA layers, each its own selections"),
                seed: int = 0, preset: str = PRESET_OPT) -> None:
    """Write a synthetic trace in the replay format (tests, demos): random selections
    calibrated to --overlap, as `qsa bench --selection random --overlap` makes them."""
    from qsa.presets import ShapeError
    from qsa.trace import describe, synth_trace, write_trace

    p = get_preset(preset)
    try:
        t = synth_trace(p, batch, _one_int(context), rows, overlap, layers, seed)
    except ShapeError as e:
        raise typer.BadParameter(str(e)) from None
    write_trace(out, t)
    console.print_json(json.dumps({"written": str(out), **describe(t)}, default=str))


DEFAULT_SWEEPS = {True: Path("sweeps/decode_scoring_gpu.yaml"),
                  False: Path("sweeps/decode_scoring_cpu.yaml")}


@app.command()
def run(out: Path = typer.Option(Path("profiles"), help="results root")) -> None:
    """The main job: the default decode scoring sweep (row-wise vs stacked scorer) and its
    design-review figures. Without a GPU, its CPU smoke version under the Triton interpreter:
    a functional run whose times mean nothing."""
    import torch

    from qsa.workbench.notebook_run import lab_command
    from qsa.workbench.sweep import run_sweep

    gpu = torch.cuda.is_available()
    spec = Path(__file__).resolve().parents[1] / DEFAULT_SWEEPS[gpu]
    if not gpu:
        console.print("[yellow]No GPU: running the CPU smoke sweep under the Triton interpreter. "
                      "This is a functional run; its times mean nothing.[/]")
    summary = run_sweep(spec, out)
    _verbatim(str(summary))  # where the executed notebooks, results and figures are
    _verbatim(f"open the notebooks in JupyterLab: {lab_command()}")
    raise typer.Exit(0 if summary.ok else 1)


if __name__ == "__main__":
    main()
