"""Interactive block-config tuning in JupyterLab: one control per config key of the kernel's
current table entry, each change verified and timed beside the current entry, and the result
written back by the tuner's own rules.

The controls and their values come from the tuner (`qsa.workbench.tune.config_axes`: the
entry's keys, half / same / double of each size, switches both ways, the warps and stages the
backend takes), the timing from `tune_prepared` (the current entry timed twice, so the run
knows its noise) and the write-back from `write_winner` with its re-check in a fresh process,
so a config kept from the widgets passed exactly what a `qsa tune --write` winner passes.
Everything but `widgets` is plain Python and tested without a browser; `widgets` needs
ipywidgets (the `lab` extra) and is built only inside JupyterLab, never under papermill.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import pandas as pd

from qsa.configs import AMD_KEYS, BlockConfig, get_config
from qsa.configs.schema import LAUNCH_KEYS
from qsa.kernels.common import Lookup, backend_and_arch
from qsa.workbench import tune as tuner
from qsa.workbench.ops import Point, Prepared, config_coordinate, prepare

LAUNCH = tuple(k.name for k in LAUNCH_KEYS)


def in_jupyterlab() -> bool:
    """True in a kernel JupyterLab (Jupyter Server) started for a notebook, which names the
    session in JPY_SESSION_NAME; papermill's kernels have no session, so sweeps and
    `qsa notebook` runs never build widgets."""
    return "JPY_SESSION_NAME" in os.environ


@dataclass(frozen=True)
class Session:
    """One point prepared for trying configs: its inputs, the table coordinate the kernel
    looks its entry up at, and that entry."""

    prep: Prepared
    coord: Lookup
    current: BlockConfig
    backend: str
    arch: str
    device: str | None
    samples: int | None

    @property
    def point(self) -> Point:
        return self.prep.point


def start(point: Point, device: str | None = None, samples: int | None = None) -> Session:
    """Prepare `point` once (inputs and reference); every later try reuses them."""
    prep = prepare(point, device)
    coord = config_coordinate(prep)
    backend, arch = backend_and_arch()
    current = get_config(coord.kernel, arch, coord.fmt, coord.size).config
    return Session(prep, coord, current, backend, arch, device, samples)


def choices(session: Session) -> dict[str, tuple[int, ...]]:
    """The values each control offers, the current entry's own value among them."""
    return tuner.config_axes(session.point.op, session.current, session.backend, session.arch)


def current_values(session: Session) -> dict[str, int]:
    """What each control shows before any change: the current entry."""
    c = session.current
    return {k: (c.meta[k] if k in c.meta else c.amd.get(k, 0) if k in AMD_KEYS
                else getattr(c, k)) for k in choices(session)}


def changes(session: Session, values: dict[str, int]) -> dict[str, Any]:
    """The controls' values as changes to the current entry (`tune.with_changes`)."""
    axes = choices(session)
    unknown = sorted(set(values) - set(axes))
    if unknown:
        raise ValueError(f"config: {unknown} are not keys of this kernel ({sorted(axes)})")
    out: dict[str, Any] = {"meta": {k: int(v) for k, v in values.items()
                                    if k in session.current.meta}}
    out.update({k: int(values[k]) for k in LAUNCH if k in values})
    amd = {k: int(values[k]) for k in AMD_KEYS if k in values}
    if amd:
        out["amd"] = amd
    return out


def try_config(session: Session, values: dict[str, int]) -> pd.DataFrame:
    """Verify and time the chosen config beside the current entry, in one run (the tuner's
    table: one row each, `status` ok or why not)."""
    return tuner.tune_prepared(session.prep, session.coord, candidates=[changes(session, values)],
                               samples=session.samples, progress=False, device=session.device)


def side_by_side(df: pd.DataFrame) -> pd.DataFrame:
    """The current entry and the chosen config: median and spread, the speedup over the
    current entry and whether it is beyond the run's noise (what a write acts on)."""
    ok = tuner.ranked(df)
    cols = ["is_current", "status", "us", "p10_us", "p90_us", "vs_current", "beyond_noise",
            "config"]
    failed = df[df["status"] != "ok"].assign(vs_current=float("nan"), beyond_noise=False)
    both = pd.concat([ok, failed], ignore_index=True).sort_values("is_current",
                                                                   ascending=False)
    return both.reindex(columns=cols).reset_index(drop=True)


def write(session: Session, df: pd.DataFrame) -> BlockConfig:
    """Write back as `qsa tune --write` does: the chosen config only when it beats the current
    entry beyond the run's noise and again in a fresh process, else the current entry,
    confirmed; interpreter timings are refused (RuntimeError)."""
    return tuner.write_winner(
        df, session.point.op, session.arch, session.coord.fmt, session.coord.size,
        recheck=lambda cur, win: tuner.recheck_in_fresh_process(
            session.point, cur, win, session.samples, session.device))


def widgets(session: Session) -> Any:
    """The controls (one dropdown per key), a button that tries the chosen config and one that
    writes it back (GPU only), and the side-by-side table; each change of a control re-runs
    the try."""
    import ipywidgets as w
    from IPython.display import display

    controls = {k: w.Dropdown(options=list(v), value=current_values(session)[k], description=k)
                for k, v in choices(session).items()}
    out = w.Output()
    keep = w.Button(description="write back", disabled=session.backend == "interpreter",
                    tooltip="the tuner's rules: beyond noise, re-checked in a fresh process")
    last: dict[str, pd.DataFrame] = {}

    def run(_: Any = None) -> None:
        with out:
            out.clear_output()
            values = {k: c.value for k, c in controls.items()}
            print("trying", json.dumps(changes(session, values), sort_keys=True))
            last["df"] = try_config(session, values)
            display(side_by_side(last["df"]))

    def write_back(_: Any) -> None:
        with out:
            if "df" not in last:
                print("try a config first")
                return
            print("table entry now:", write(session, last["df"]).as_dict())

    for c in controls.values():
        c.observe(run, names="value")
    keep.on_click(write_back)
    return w.VBox([w.HBox(list(controls.values()), layout=w.Layout(flex_flow="row wrap")),
                   keep, out])
