"""Interactive tuning (the logic behind the notebook's widgets): controls derived from the
config table's entry, a try verified and timed beside the current entry, the tuner's
write-back rules, and no widgets outside JupyterLab."""

from __future__ import annotations

import pytest

from qsa.presets import get_preset
from qsa.workbench import interactive as ui
from qsa.workbench import tune as tuner
from qsa.workbench.ops import Point


@pytest.fixture(scope="module")
def session() -> ui.Session:
    return ui.start(Point("score_stacked", get_preset("qwen3.8-flash-next"), 1, 512, 4),
                    device="cpu", samples=1)


def test_controls_are_the_entrys_keys_over_the_tuners_values(session: ui.Session) -> None:
    axes = ui.choices(session)
    ints = {k for k, v in session.current.meta.items() if type(v) is int}
    assert set(axes) == ints | {"num_warps", "num_stages"}
    assert axes == tuner.config_axes("score_stacked", session.current, session.backend,
                                     session.arch)
    now = ui.current_values(session)
    assert all(now[k] in axes[k] for k in axes)  # each control starts at the current entry
    assert now["num_warps"] == session.current.num_warps


def test_the_controls_values_become_changes_to_the_current_entry(session: ui.Session) -> None:
    key = sorted(k for k in ui.choices(session) if k in session.current.meta)[0]
    other = next(v for v in ui.choices(session)[key] if v != session.current.meta[key])
    values = {**ui.current_values(session), key: other}
    ch = ui.changes(session, values)
    assert ch["meta"][key] == other and ch["num_warps"] == session.current.num_warps
    assert tuner.with_changes(session.current, ch).meta[key] == other
    with pytest.raises(ValueError, match=r"\['BLOCK_Q'\] are not keys"):
        ui.changes(session, {"BLOCK_Q": 1})


def test_a_try_is_verified_and_timed_beside_the_current_entry(session: ui.Session) -> None:
    warps = next(w for w in ui.choices(session)["num_warps"] if w != session.current.num_warps)
    df = ui.try_config(session, {**ui.current_values(session), "num_warps": warps})
    assert list(df["is_current"]) == [True, False] and (df["status"] == "ok").all()
    table = ui.side_by_side(df)
    assert list(table["is_current"]) == [True, False]
    assert table["vs_current"].iloc[0] == pytest.approx(1.0)
    assert '"num_warps": %d' % warps in table["config"].iloc[1]
    with pytest.raises(RuntimeError, match="interpreter timings mean nothing; nothing written"):
        ui.write(session, df)  # the tuner's rule: interpreter times are never written


def test_widgets_only_in_a_jupyterlab_session(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    assert not ui.in_jupyterlab()  # papermill, qsa notebook, sweeps
    monkeypatch.setenv("JPY_SESSION_NAME", "/work/notebooks/block_config_tuning.ipynb")
    assert ui.in_jupyterlab()


def test_the_widgets_hold_one_control_per_key(session: ui.Session) -> None:
    pytest.importorskip("ipywidgets")
    box = ui.widgets(session)
    controls = box.children[0].children
    assert [c.description for c in controls] == list(ui.choices(session))
    assert box.children[1].disabled  # no write-back from interpreter timings
