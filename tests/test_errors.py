"""Mistakes end in one clear line: the command line's numeric options and model fields
(exit code 2, the option, the value and what it may be, no traceback), compile's timeout,
and the natural call `cm.train_step(*cm.shard_inputs(*batch))`, which now works."""
from __future__ import annotations

import copy

import pytest
import torch

import autopar
from autopar.cli import main

# --- the command line ----------------------------------------------------------------------

TINY = ["plan", "--model", "gpt-tiny", "--mesh", "2", "--no-compare"]

CLI_ERRORS = [  # (argv, the one line printed after "autopar plan: error: ")
    (TINY + ["--batch", "-4"],
     "--batch -4: the global batch of the example inputs must be a whole number of at least 1, e.g. --batch 8"),
    (TINY + ["--batch", "0"],
     "--batch 0: the global batch of the example inputs must be a whole number of at least 1, e.g. --batch 8"),
    (TINY + ["--seq", "0"],
     "--seq 0: the sequence length of the example inputs must be a whole number of at least 1, e.g. --seq 2048"),
    (TINY + ["--set", "n_heads=0"], "--set n_heads=0: GPTConfig.n_heads must be a whole number of at least 1"),
    (TINY + ["--set", "n_heads=3"],
     "--set n_heads=3: GPTConfig.n_heads must divide hidden=64 (one of 1, 2, 4, 8, 16, 32, 64), or change hidden"),
    (TINY + ["--set", "hidden=-8"], "--set hidden=-8: GPTConfig.hidden must be a whole number of at least 1"),
    (TINY + ["--set", "vocab=0"], "--set vocab=0: GPTConfig.vocab must be a whole number of at least 1"),
    (TINY + ["--set", "dropout=2"], "--set dropout=2: GPTConfig.dropout must be a probability in [0, 1]"),
    (["plan", "--model", "llama-tiny", "--mesh", "2", "--set", "n_kv_heads=3"],
     "--set n_kv_heads=3: LlamaConfig.n_kv_heads must divide n_heads=4 (one of 1, 2, 4), or change n_heads"),
    (TINY + ["--microbatches", "0"], "--microbatches 0: the pipeline microbatches per step must be a whole number "
                                     "of at least 1, e.g. --microbatches 8"),
    (TINY + ["--pipeline-stages", "1"], "--pipeline-stages 1: the number of pipeline stages must be a whole number "
                                        "of at least 2, e.g. --pipeline-stages 2"),
    (TINY + ["--budget", "0.5"], "--budget '0.5' is 0.5 bytes per device, under 1 MiB: a size without a unit is "
                                 "in bytes; write the unit, e.g. --budget 0.5GiB"),
    (TINY + ["--budget=-5GiB"], "--budget '-5GiB' is not a positive, finite number of bytes; write a positive size "
                                "such as '70GiB', '80GB' or a number of bytes"),
    (TINY + ["--bandwidth", "-1"], "cannot read --bandwidth '-1'; give one positive GB/s per mesh axis joined by "
                                   "',', e.g. --bandwidth 2.5"),
    (["plan", "--model", "gpt-tiny", "--mesh", "0"],
     "cannot read --mesh '0'; write the positive axis sizes joined by 'x', e.g. --mesh 8x8 or --mesh 64"),
    (["plan", "--model", "gpt-tiny", "--mesh", "2x-2"],
     "cannot read --mesh '2x-2'; write the positive axis sizes joined by 'x', e.g. --mesh 8x8 or --mesh 64"),
]


@pytest.mark.parametrize("argv,line", CLI_ERRORS, ids=[" ".join(a[len(TINY):] if a[:len(TINY)] == TINY else a[1:])
                                                      for a, _ in CLI_ERRORS])
def test_a_bad_number_is_one_line_and_exit_code_2(capsys, argv, line):
    assert main(["-q", *argv]) == 2
    err = capsys.readouterr().err
    assert err == f"autopar plan: error: {line}\n"


def test_hf_config_fields_that_count_must_be_positive(capsys):
    pytest.importorskip("transformers")
    assert main(["-q", "plan", "--hf", "llama", "--mesh", "2", "--set", "num_attention_heads=0"]) == 2
    assert capsys.readouterr().err == ("autopar plan: error: --set num_attention_heads=0: "
                                       "LlamaConfig.num_attention_heads must be a whole number of at least 1\n")
    assert main(["-q", "plan", "--hf", "llama", "--mesh", "2", "--batch", "-1"]) == 2
    assert capsys.readouterr().err.startswith("autopar plan: error: --batch -1: the global batch")
    # what transformers itself refuses comes back as one line naming the --set values
    assert main(["-q", "plan", "--hf", "llama", "--mesh", "2", "--set", "hidden_size=100",
                 "--set", "num_attention_heads=3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("autopar plan: error: transformers builds no causal LM from --hf 'llama' with "
                          "--set hidden_size=100 --set num_attention_heads=3: ") and "(100)" in err
    assert err.endswith("; check the --set values\n"), err


def test_calibrate_repeats_must_be_positive(capsys):
    assert main(["-q", "calibrate", "--repeats", "0"]) == 2
    assert capsys.readouterr().err == ("autopar calibrate: error: --repeats 0: the timed runs per measurement must "
                                       "be a whole number of at least 1, e.g. --repeats 5\n")


def test_build_names_the_field():
    from autopar.models import ConfigError, build
    with pytest.raises(ConfigError, match=r"^batch=-4: the example inputs' batch of 'gpt-tiny' must be a whole "
                                          r"number of at least 1$"):
        build("gpt-tiny", device="meta", batch=-4)
    with pytest.raises(ConfigError, match=r"^n_layers=True: MLPConfig.n_layers must be a whole number of at least 1$"):
        build("mlp", device="meta", n_layers=True)
    with pytest.raises(ConfigError, match=r"^rope_theta=0: LlamaConfig.rope_theta must be a finite number above 0$"):
        build("llama-tiny", device="meta", rope_theta=0)


# --- compile's timeout -----------------------------------------------------------------------

SHORT, NOT_A_NUMBER = "under the least timeout, 1 s", "not a finite number of seconds"


@pytest.mark.parametrize("timeout,problem", [(0.05, SHORT), (0, SHORT), (float("nan"), NOT_A_NUMBER),
                                             (None, NOT_A_NUMBER)])
def test_compile_refuses_a_timeout_no_job_can_meet(timeout, problem):
    """Refused at the call, before any process group is needed (it used to be accepted and
    then end compile with a CollectiveError after 50 ms)."""
    with pytest.raises(ValueError) as caught:
        autopar.compile(torch.nn.Linear(2, 2), autopar.Mesh((2,), ("dp",), device="cpu"), (torch.ones(2, 2),),
                        run=autopar.RunOptions(timeout=timeout))
    assert str(caught.value) == (
        f"autopar.RunOptions(timeout={timeout!r}): {problem}. The timeout bounds how long every collective waits for "
        f"the slowest rank, compile's own included (setting up the gloo or NCCL process groups and waiting for "
        f"ranks that trace the model more slowly take seconds); give timeout=60 or more (the default is 600)")


# --- shard_inputs -----------------------------------------------------------------------------

def sharded_calls(plan_dict: dict) -> dict:
    """On each of 2 ranks, an HF Llama (keyword inputs) compiled with local_inputs=True and
    called with cm.shard_inputs' result every way: the losses, how far the gradients of one
    train_step(*cm.shard_inputs(...)) are from one device's, and the errors of the mixes."""
    from autopar.report.plan import Plan
    from autopar.runtime.checks.inputs import InputError
    from hf_archs import build
    from rt_cases import excess
    plan = Plan.from_dict(plan_dict)
    model, kwargs = build("llama")
    reference = copy.deepcopy(model)
    loss = reference(**kwargs).loss
    loss.backward()
    cm = autopar.compile(model, plan.mesh, example_kwargs=kwargs, plan=plan, run=autopar.RunOptions(local_inputs=True))
    sharded = cm.shard_inputs(**kwargs)
    args, kw = sharded                                           # the documented use
    out = {"one device": loss.item(), "halves": (len(args), sorted(kw))}
    out["star"] = cm.train_step(*cm.shard_inputs(**kwargs)).item()   # the natural one
    out["grad"] = max(excess(g, reference.get_parameter(n).grad) for n, g in cm.full_grads().items())
    with torch.no_grad():
        out["documented"] = cm(*args, **kw).loss.item()
        out["whole"] = cm(sharded).loss.item()
        out["forward star"] = cm(*sharded).loss.item()
    errors = {}
    for name, call in (("extra", lambda: cm.train_step(*sharded, attention_mask=None)),
                       ("kwargs only", lambda: cm.train_step(sharded.kwargs))):
        try:
            call()
        except InputError as exc:
            errors[name] = str(exc)
    out["errors"] = errors
    return out


def test_train_step_takes_shard_inputs_as_it_comes(pool2):
    """`cm.train_step(*cm.shard_inputs(*batch))` (it failed with a TreeSpec dump: shard_inputs
    gives (args, kwargs)) trains as the documented `args, kwargs = cm.shard_inputs(...);
    cm.train_step(*args, **kwargs)`: the same loss as one device, and gradients equal to its;
    forward takes it whole or star-unpacked too.  Mixed with other inputs, the error says
    how to call."""
    pytest.importorskip("transformers")
    from hf_archs import build
    from rt_cases import ATOL, RTOL
    model, kwargs = build("llama")
    plan = autopar.plan(model, autopar.Mesh((2,), ("dp",), device="cpu"), example_kwargs=kwargs,
                        solve=autopar.SolveOptions(compare=False, layout="data-parallel"))
    for out in pool2.run(sharded_calls, plan.to_dict()):
        assert out["halves"] == (0, ["input_ids", "labels"])
        for how in ("star", "documented", "whole", "forward star"):
            assert out[how] == pytest.approx(out["one device"], rel=RTOL, abs=ATOL), (how, out)
        assert out["grad"] <= 0, out
        use = "args, kwargs = cm.shard_inputs(...); cm.train_step(*args, **kwargs)"
        said = ("the pair (args, kwargs) of this rank's shards; train_step and forward take it only as their one "
                f"input, whole or star-unpacked. Call {use}")
        assert out["errors"] == {"extra": f"positional input 0 is the args of what cm.shard_inputs returned, {said}",
                                 "kwargs only": f"positional input 0 is the kwargs of what cm.shard_inputs returned, "
                                                f"{said}"}


@pytest.mark.parametrize("option,value,message", [
    ("bucket_mb", 0, "the gradient bucket size must be a positive number of MiB (25 is DDP's default; larger "
                     "buckets mean fewer, later all-reduces)"),
    ("bucket_mb", float("inf"), "the gradient bucket size must be a positive number of MiB (25 is DDP's default; "
                                "larger buckets mean fewer, later all-reduces)"),
    ("check_inputs", -1, "how many first calls compare every input's hash; a whole number of at least 0 "
                         "(0 turns it off)"),
    ("check_inputs_every", 2.5, "after those, every how many calls one is compared; a whole number of at least 0 "
                                "(0 turns it off)"),
])
def test_compile_refuses_option_values_it_cannot_use(option, value, message):
    """Refused where the run options are made, before any process group is needed."""
    with pytest.raises(ValueError) as caught:
        autopar.RunOptions(**{option: value})
    assert str(caught.value) == f"autopar.RunOptions({option}={value!r}): {message}"
