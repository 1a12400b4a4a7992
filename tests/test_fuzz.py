"""Property test: models drawn from a grammar (tests/fuzz_cases.py), meshes of one to three
axes, the solver's plan, a hand-written layout or a random valid plan, and a training
loop's habits, each trained on the worker pool's ranks and compared with one device.

A draw passes when the compiled loop's losses, clip norms, eval losses and final
parameters equal one device's, or when planning refuses the draw with an error that names
what is wrong (a layout that does not apply to the model, say).  The fast tier draws a
few cases; `pytest -m slow` draws 40 on four ranks and 12 on eight (2 x 2 x 2), about 3.5 s
a draw on 2 cores.  The seed is fixed (derandomized), so a failure reproduces; set
AUTOPAR_FUZZ_EXAMPLES to draw more (200 or more before a release).  Each test prints how
many draws trained, were refused, and what refused them.
"""
from __future__ import annotations

import collections
import os

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import autopar
from autopar.solve.layouts import layouts
from fuzz_cases import BLOCKS, Loop, Spec, build, batches, compare, compiled, reference

MESHES_4 = (((4,), ("dp",)), ((2, 2), ("dp", "tp")), ((2, 2, 1), ("dp", "tp", "sp")))
MESHES_8 = (((2, 2, 2), ("dp", "tp", "sp")), ((2, 4), ("dp", "tp")))


@st.composite
def specs(draw, batch: int):
    blocks = tuple(draw(st.lists(st.sampled_from(BLOCKS), min_size=1, max_size=3)))
    return Spec(blocks=blocks, hidden=draw(st.sampled_from((16, 32))), norm=draw(st.sampled_from(("layer", "rms"))),
                post_norm=draw(st.booleans()), bias=draw(st.booleans()), tied=draw(st.booleans()),
                frozen=draw(st.sampled_from(("", "", "embed", "blocks.0."))),
                dropout=draw(st.sampled_from((0.0, 0.0, 0.1))), buffer=draw(st.booleans()),
                view_after_attention=draw(st.booleans()), batch=batch, seq=draw(st.sampled_from((8, 16))))


loops = st.builds(Loop, steps=st.sampled_from((1, 2)), clip=st.sampled_from((None, None, 0.05)),
                  accumulate=st.booleans(), eval_between=st.booleans(), checkpoint=st.booleans(),
                  pretrained=st.booleans())


@st.composite
def draws(draw, meshes, batch: int):
    spec = draw(specs(batch))
    loop = draw(loops)
    shape, names = draw(st.sampled_from(meshes))
    mesh = autopar.Mesh(shape, names, device="cpu")
    choices = ["solver", "random", "random"] + sorted(layouts(mesh, every=True))
    kinds = [draw(st.sampled_from(choices)) for _ in range(2)]
    seeds = [draw(st.integers(0, 10_000)) for _ in range(2)]
    return spec, loop, mesh, list(zip(kinds, seeds))


def _plan(spec: Spec, mesh, kind: str, seed: int):
    model = build(spec)
    example = batches(spec, 1)[0]
    if kind == "solver":
        return autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False))
    if kind == "random":
        return autopar.random_plans(model, mesh, example, solve=autopar.SolveOptions(compare=False), seeds=(seed,))[0]
    return autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False, layout=kind))


def _examples(default: int) -> int:
    return int(os.environ.get("AUTOPAR_FUZZ_EXAMPLES", default))


class Tally:
    """What the draws of one test came to, printed at its end."""

    def __init__(self, name: str):
        self.name, self.outcomes, self.failures = name, collections.Counter(), []

    def __call__(self, outcome: str) -> None:
        self.outcomes[outcome] += 1

    def failed(self, what: str, why: str) -> None:
        self("failed")
        self.failures.append(f"{what}\n{why}")

    def report(self) -> str:
        total = sum(self.outcomes.values())
        return f"{self.name}: {total} draws: " + "; ".join(f"{n} {k}" for k, n in self.outcomes.most_common())


def _check(pool, draw_, tally: Tally, tmp_root) -> None:
    spec, loop, mesh, plans = draw_
    try:
        planned = [_plan(spec, mesh, kind, seed) for kind, seed in plans]
    except (ValueError, NotImplementedError) as exc:   # a refusal must say what to do
        text = str(exc)
        assert len(text) > 30 and "Traceback" not in text, text
        tally(f"refused ({type(exc).__name__}: {text.splitlines()[0][:60]})")
        return
    path = os.path.join(tmp_root, f"ckpt-{tally.outcomes.total()}")
    what = f"{spec} | {loop} | mesh {mesh.shape} | plans {plans}"
    try:
        got = pool.run(compiled, spec, loop, planned[0].to_dict(), planned[1].to_dict(), path)[0]
    except Exception as exc:   # (every failing draw is reported at the end, not only the first)
        tally.failed(what, f"{type(exc).__name__}: {str(exc)[-1500:]}")
        return
    problems = compare(got, reference(spec, loop))
    if problems:
        tally.failed(what, "\n".join(problems[:12]))
    else:
        tally("trained equal to one device")


def _fuzz(pool, meshes, batch, examples, name, tmp_path_factory):
    tally = Tally(name)
    root = str(tmp_path_factory.mktemp("fuzz"))

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              phases=(Phase.explicit, Phase.generate),
              suppress_health_check=list(HealthCheck))
    @given(draws(meshes, batch))
    def run(draw_):
        _check(pool, draw_, tally, root)

    try:
        run()
    finally:
        print(tally.report())
    assert not tally.failures, f"{len(tally.failures)} draws failed:\n\n" + "\n\n".join(tally.failures)
    assert tally.outcomes["trained equal to one device"] >= examples // 2, tally.report()


def test_drawn_models_plans_and_loops_train_as_on_one_device(pool4, tmp_path_factory):
    _fuzz(pool4, MESHES_4, 4, _examples(6), "fast, 4 ranks", tmp_path_factory)


@pytest.mark.slow
def test_forty_draws_on_four_ranks(pool4, tmp_path_factory):
    _fuzz(pool4, MESHES_4, 4, _examples(40), "slow, 4 ranks", tmp_path_factory)


@pytest.mark.slow
def test_draws_on_eight_ranks(pool8, tmp_path_factory):
    _fuzz(pool8, MESHES_8, 8, _examples(6), "slow, 8 ranks", tmp_path_factory)


@pytest.mark.parametrize("layout", ["ulysses x dp", "context-parallel x dp"])
@pytest.mark.parametrize("fused", [False, True])
def test_view_after_attention_under_sequence_layouts(pool4, tmp_path, layout, fused):
    """Found by the draws: nanoGPT's `y.transpose(1, 2).contiguous().view(b, s, h)` after
    attention.  The trace drops the `.contiguous()` (a no-op for the traced kernel's
    output), so ring and Ulysses attention must return their output in the traced layout
    (autopar/passes/local_ops.py, in_dim_order) or the `.view` fails."""
    spec = Spec(blocks=("attn_fused" if fused else "attn", "mlp"), hidden=32, view_after_attention=True, seq=16)
    loop = Loop(steps=2)
    mesh = autopar.Mesh((2, 2), ("dp", "tp"), device="cpu")
    plan = _plan(spec, mesh, layout, 0).to_dict()
    got = pool4.run(compiled, spec, loop, plan, None, str(tmp_path / "ckpt"))[0]
    assert compare(got, reference(spec, loop)) == []


def test_stacked_experts_resume_under_zero3(pool4, tmp_path):
    """Found by the draws: an AdamW state of stacked experts under ZeRO-3, loaded by
    autopar.checkpoint.load, is read from the storage DCP wrote it into (through the DTensors
    optimizer_state_dict gave) in another view: the copy must not read what it overwrites."""
    spec = Spec(blocks=("moe", "mlp"), hidden=32, norm="rms", frozen="embed", view_after_attention=False)
    loop = Loop(steps=2, accumulate=True, checkpoint=True, pretrained=True)
    mesh = autopar.Mesh((2, 2), ("dp", "tp"), device="cpu")
    plan = _plan(spec, mesh, "zero3", 0).to_dict()
    got = pool4.run(compiled, spec, loop, plan, plan, str(tmp_path / "ckpt"))[0]
    assert compare(got, reference(spec, loop)) == []
