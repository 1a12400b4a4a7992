"""The faces take records: autopar.plan (Pricing, SolveOptions), autopar.random_plans (plan's
request and seeds) and autopar.compile (RunOptions).  Each record checks its own values;
the old keywords still work for one release, give the same result and warn once."""
import inspect
import warnings

import pytest
import torch

import autopar
from autopar.models import build

FACE_BUDGET = 10


def _model():
    torch.manual_seed(0)
    return build("gpt-tiny")


def _untimed(plan) -> dict:
    """A plan's record less how long planning took."""
    return {k: v for k, v in plan.to_dict().items() if k != "timing"}


def test_faces_fit_their_parameter_budget_and_show_every_option():
    for face in (autopar.plan, autopar.compile):
        params = inspect.signature(face).parameters.values()
        assert len(params) <= FACE_BUDGET, face.__name__
        assert not [p for p in params if p.kind is p.VAR_KEYWORD], face.__name__
    assert {"pricing", "solve"} <= set(inspect.signature(autopar.plan).parameters)
    assert "run" in inspect.signature(autopar.compile).parameters


@pytest.mark.parametrize("record,kwargs,says", [
    (autopar.Pricing, {"accumulation": 0}, "accumulation=0"),
    (autopar.Pricing, {"backend": "jax"}, "backend='jax'"),
    (autopar.Pricing, {"tp_overlap": "yes"}, "tp_overlap='yes'"),
    (autopar.Pricing, {"moe_imbalance": 0.5}, "moe_imbalance=0.5"),
    (autopar.SolveOptions, {"time_limit": 0}, "time_limit=0"),
    (autopar.SolveOptions, {"workers": 0}, "workers=0"),
    (autopar.SolveOptions, {"layout": 3}, "layout=3"),
    (autopar.RunOptions, {"timeout": 0.001}, "timeout=0.001"),
    (autopar.RunOptions, {"bucket_mb": -1}, "bucket_mb=-1"),
    (autopar.RunOptions, {"check_inputs": -1}, "check_inputs=-1"),
    (autopar.RunOptions, {"backend": "xla"}, "backend='xla'"),
])
def test_each_record_checks_its_own_values(record, kwargs, says):
    with pytest.raises(ValueError, match=f"autopar.{record.__name__}\\({says.replace('(', '.').replace(')', '.')}"):
        record(**kwargs)


def test_records_are_frozen_and_keyword_only():
    with pytest.raises(TypeError):
        autopar.SolveOptions(5.0)   # positional: which field would it be?
    options = autopar.RunOptions(timeout=90)
    with pytest.raises(AttributeError):
        options.timeout = 5
    assert options.timeout == 90.0 and autopar.Pricing(moe_imbalance={4: 1.5, 2: 1.2}).moe_imbalance == {2: 1.2, 4: 1.5}


def test_old_plan_keywords_give_the_same_plan_and_warn_once():
    model, x = _model()
    mesh = autopar.Mesh((2, 2), ("dp", "tp"), device="cpu")
    new = autopar.plan(model, mesh, x, pricing=autopar.Pricing(accumulation=2),
                       solve=autopar.SolveOptions(compare=False, layout="megatron-tp x dp", time_limit=30))
    with pytest.warns(autopar.AutoparDeprecationWarning) as caught:
        old = autopar.plan(model, mesh, x, compare=False, layout="megatron-tp x dp", time_limit=30, accumulation=2)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "autopar.plan(compare=, layout=, time_limit=, accumulation=) is deprecated" in message
    assert "solve=autopar.SolveOptions(compare=False, layout='megatron-tp x dp', time_limit=30)" in message
    assert "pricing=autopar.Pricing(accumulation=2)" in message
    assert caught[0].filename == __file__   # the warning points at the caller's line
    assert _untimed(old) == _untimed(new) and old.accumulation == 2


def test_an_old_keyword_beside_its_record_is_refused():
    model, x = _model()
    mesh = autopar.Mesh((2,), ("dp",), device="cpu")
    with pytest.raises(TypeError, match="time_limit= and solve= both given"):
        autopar.plan(model, mesh, x, time_limit=5, solve=autopar.SolveOptions(compare=False))


def test_random_plans_take_plans_request_and_old_seed_keywords_still_work():
    model, x = _model()
    mesh = autopar.Mesh((2, 2), ("dp", "tp"), device="cpu")
    quick = autopar.SolveOptions(compare=False)
    new = autopar.random_plans(model, mesh, x, seeds=range(3, 5), solve=quick)
    assert [p.origin for p in new] == ["random:3", "random:4"]
    with pytest.warns(autopar.AutoparDeprecationWarning, match=r"seeds=range\(3, 5\)"):
        old = autopar.random_plans(model, mesh, x, seed=3, count=2, solve=quick)
    assert [_untimed(p) for p in old] == [_untimed(p) for p in new]
    with pytest.raises(TypeError, match="random_plans got memory=: it takes seeds= and autopar.plan's keywords"):
        autopar.random_plans(model, mesh, x, memory="1GiB")
    with pytest.raises(ValueError, match="seeds= is empty"):
        autopar.random_plans(model, mesh, x, seeds=())


def test_old_compile_keywords_fold_into_run_options():
    from autopar.deprecations import folded
    from autopar.runtime.compiled import COMPILE_MOVES
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records = folded("autopar.compile", COMPILE_MOVES, {"timeout": 90, "local_inputs": True}, {})
    assert records == {"run": autopar.RunOptions(timeout=90, local_inputs=True)}
    assert [w.category for w in caught] == [autopar.AutoparDeprecationWarning]
    assert "run=autopar.RunOptions(timeout=90, local_inputs=True)" in str(caught[0].message)
    with pytest.raises(TypeError, match="timeout= and run= both given"):
        folded("autopar.compile", COMPILE_MOVES, {"timeout": 90}, {"run": autopar.RunOptions()})
