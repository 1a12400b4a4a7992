"""The command line, called in-process (autopar.cli.main): each `plan` flag changes the plan
as it says (bf16 halves the parameter bytes, --pipeline cuts stages across a slow
network, --recompute trades activations for time, --hf builds a transformers model),
--json and --html write what they promise, `compare` names the layouts that changed, and
`--help` shows every subcommand with an example."""
from __future__ import annotations

import json

import pytest

import autopar
from autopar.cli import build_parser, main
from autopar.models import build
from autopar.report.text import table_rows


def plan_of(tmp_path, capsys, *argv, name="plan.json"):
    """Run `autopar plan ARGV --save` and return (the saved Plan, what it printed)."""
    path = tmp_path / name
    capsys.readouterr()
    assert main(["-q", "plan", *argv, "--save", str(path)]) == 0
    return autopar.Plan.load(path), capsys.readouterr().out


def test_bf16_halves_parameter_bytes(tmp_path, capsys):
    bf16, _ = plan_of(tmp_path, capsys, "--model", "gpt-tiny", "--mesh", "2x2", "--precision", "bf16", name="a.json")
    fp32, _ = plan_of(tmp_path, capsys, "--model", "gpt-tiny", "--mesh", "2x2", "--precision", "fp32", name="b.json")
    default, _ = plan_of(tmp_path, capsys, "--model", "gpt-tiny", "--mesh", "2x2", name="c.json")   # h100: bf16
    assert bf16.precision is not None and fp32.precision is None and default.precision == bf16.precision
    assert bf16.predicted.memory["params"] * 2 == fp32.predicted.memory["params"]
    model, _ = build("gpt-tiny", device="meta")
    n = sum(p.numel() for p in model.parameters())
    assert fp32.predicted.memory["params"] <= 4 * n                        # split or whole, never more


def test_json_summary(tmp_path, capsys):
    plan, out = plan_of(tmp_path, capsys, "--model", "gpt-tiny", "--mesh", "2x2", "--json")
    d = json.loads(out)
    assert d["hash"] == plan.hash() and d["model"] == "GPT"
    assert d["step_s"] == d["predicted"]["step_s"] == plan.predicted.step_s
    assert d["predicted"]["memory_total"] == plan.predicted.memory_total
    assert d["mesh"] == {"shape": [2, 2], "axes": ["dp", "tp"], "device": "h100", "inside_node": [True, True]}
    assert set(d["baselines"]) == set(plan.baselines) and d["nodes"] == len(plan.nodes)


def test_pipeline_search_cuts_stages_across_a_slow_network(tmp_path, capsys):
    """gpt2-124m on 8 nodes of 8 whose network is 2.5 GB/s: stages across nodes beat
    all-reducing gradients over it."""
    plan, out = plan_of(tmp_path, capsys, "--model", "gpt2-124m", "--mesh", "8x8", "--axes", "node,gpu",
                        "--bandwidth", "2.5,450", "--batch", "16", "--precision", "fp32", "--no-compare",
                        "--pipeline", "--json")
    pp = plan.pipeline
    assert pp.pipelined and pp.axis == "node" and len(pp.stages) > 1
    assert pp.step_s < pp.no_pipeline_step_s
    assert plan.device_mesh().bandwidth == (2.5e9, 450e9)
    assert json.loads(out)["pipeline"]["stages"] == len(pp.stages)


def test_fixed_pipeline_and_html(tmp_path, capsys):
    html = tmp_path / "pp.html"
    plan, _ = plan_of(tmp_path, capsys, "--model", "gpt-tiny", "--mesh", "2x2", "--axes", "pp,dp",
                      "--pipeline-stages", "2", "--schedule", "1f1b", "--microbatches", "4", "--no-compare",
                      "--html", str(html))
    pp = plan.pipeline
    assert (pp.axis, pp.groups, len(pp.stages), pp.schedule, pp.microbatches) == ("pp", 2, 2, "1f1b", 4)
    assert plan.mesh.shape == (1, 2)                                      # one stage's sub-mesh
    text = html.read_text()
    assert text.count('class="event F"') == 2 * 4 and 'class="chart gantt"' in text
    assert main(["-q", "plan", "--model", "gpt-tiny", "--mesh", "2x2", "--pipeline-stages", "3"]) == 2
    assert "Pipeline(groups=3)" in capsys.readouterr().err


def test_recompute_trades_activations_for_time(tmp_path, capsys):
    keep, _ = plan_of(tmp_path, capsys, "--model", "gpt-tiny", "--mesh", "2x2", "--recompute", "none",
                      "--no-compare", name="keep.json")
    full, _ = plan_of(tmp_path, capsys, "--model", "gpt-tiny", "--mesh", "2x2", "--recompute", "full",
                      "--no-compare", name="full.json")
    assert keep.recompute is None or not keep.recompute.layers
    assert set(full.recompute.layers.values()) == {"full"} and len(full.recompute.layers) == 2   # both blocks
    assert full.predicted.memory["activations"] < keep.predicted.memory["activations"]
    assert full.predicted.compute_s > keep.predicted.compute_s


def test_hf_config_by_name_and_by_file(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    small = ["--set", "num_hidden_layers=2", "--set", "hidden_size=64", "--set", "intermediate_size=128",
             "--set", "num_attention_heads=4", "--set", "num_key_value_heads=2", "--set", "vocab_size=256"]
    by_name, _ = plan_of(tmp_path, capsys, "--hf", "llama", *small, "--mesh", "2x2", "--seq", "32", "--batch", "4",
                         "--no-compare", name="name.json")
    assert by_name.model == "LlamaForCausalLM"
    assert by_name.layers == (("model.layers", (0, 1)),)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256)
    cfg.save_pretrained(tmp_path / "cfg")
    by_file, _ = plan_of(tmp_path, capsys, "--hf", str(tmp_path / "cfg" / "config.json"), "--mesh", "2x2",
                         "--seq", "32", "--batch", "4", "--no-compare", name="file.json")
    assert by_file.graph == by_name.graph and by_file.predicted == by_name.predicted
    assert main(["-q", "plan", "--hf", "no-such-architecture", "--mesh", "2"]) == 2
    assert "neither a file nor a model type" in capsys.readouterr().err


def test_compare_names_the_layouts_that_changed(tmp_path, capsys):
    model, example = build("gpt-tiny", device="meta")
    mesh = autopar.Mesh((2, 2), ("dp", "tp"), device="h100")
    dp = autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False, layout="data-parallel"))
    tp = autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False, layout="megatron-tp (all axes)"))
    dp.save(tmp_path / "dp.json")
    tp.save(tmp_path / "tp.json")
    capsys.readouterr()
    assert main(["-q", "compare", str(tmp_path / "dp.json"), str(tmp_path / "tp.json")]) == 0
    out = capsys.readouterr().out
    theirs = {n.name: n for n in tp.nodes}
    changed = [r for r in table_rows(dp)
               if any((theirs[n.name].strategy, theirs[n.name].outputs) != (n.strategy, n.outputs) for n in r.nodes)]
    rows = table_rows(dp)
    assert f"layouts that changed ({len(changed)} of {len(rows)} rows of A's table):" in out and changed
    fc1 = next(r for r in changed if r.label.startswith("blocks.0-1.mlp.fc1.weight"))
    line = next(x for x in out.splitlines() if x.strip().startswith(fc1.label + " "))
    assert line.split(":", 1)[1].split("->")[0].strip() == (fc1.strategy + " " + fc1.layout).strip()
    assert theirs[fc1.nodes[0].name].strategy in line.split("->")[-1]
    ratio = tp.predicted.step_s / dp.predicted.step_s
    assert f"({ratio:.2f}x)" in out.splitlines()[2]
    assert main(["-q", "compare", str(tmp_path / "dp.json"), str(tmp_path / "dp.json")]) == 0
    assert "layouts: the same" in capsys.readouterr().out


def test_help_lists_every_subcommand_with_an_example(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    commands = build_parser()._subparsers._group_actions[0].choices
    assert set(commands) == {"models", "plan", "report", "compare", "calibrate"}
    for name in commands:
        examples = out.split("commands, one example each:")[1]
        example = next(line for line in examples.splitlines() if line.strip().startswith(name + " "))
        assert "autopar" in example.split(name, 1)[1], example


def test_report_of_a_missing_file(tmp_path, capsys):
    assert main(["-q", "report", str(tmp_path / "nope.json")]) == 2
    assert "no plan file" in capsys.readouterr().err


def test_accumulation_prices_the_optimizer_once_per_micro_steps(tmp_path, capsys):
    one, _ = plan_of(tmp_path, capsys, "--model", "gpt-tiny", "--mesh", "4", "--no-compare", name="a.json")
    acc, out = plan_of(tmp_path, capsys, "--model", "gpt-tiny", "--mesh", "4", "--no-compare", "--accumulation", "8",
                       name="b.json")
    assert acc.accumulation == 8 and one.accumulation == 1
    assert "gradient accumulation over 8 micro-steps" in out
    optimizer = [sum(n.compute_s for n in p.nodes if n.op == "parameter") for p in (one, acc)]
    assert optimizer[0] > 0 and optimizer[1] < optimizer[0]
    assert main(["-q", "plan", "--model", "gpt-tiny", "--mesh", "4", "--accumulation", "0"]) == 2
    assert "accumulation=0" in capsys.readouterr().err


def test_a_negative_or_malformed_size_is_named(capsys):
    """`--budget -5GiB` reaches the budget's own check (argparse alone took the value for an
    option and said "expected one argument"), as does a unit it cannot read."""
    for value, says in (("-5GiB", "not a positive, finite number of bytes"), ("5XB", "cannot read --budget"),
                        ("-0.5", "not a positive")):
        assert main(["-q", "plan", "--model", "gpt-tiny", "--mesh", "4", "--budget", value]) == 2
        err = capsys.readouterr().err
        assert says in err and value in err and "expected one argument" not in err, err


def test_a_file_mistake_is_named_without_a_traceback(tmp_path, capsys):
    """A plan or report written into a folder that does not exist, a folder given as the
    plan to report, and a config file that is a JSON list: each is one line naming the path
    and the fix, exit status 2, no traceback (they were FileNotFoundError, IsADirectoryError
    and TypeError tracebacks)."""
    missing = tmp_path / "no-such-folder"
    cases = [(["plan", "--model", "gpt-tiny", "--mesh", "2", "--no-compare", "--save", str(missing / "p.json")],
              f"its folder {missing} does not exist"),
             (["plan", "--model", "gpt-tiny", "--mesh", "2", "--no-compare", "--html", str(missing / "p.html")],
              f"its folder {missing} does not exist"),
             (["report", str(tmp_path)], f"{tmp_path} is a folder")]
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    cases.append((["plan", "--hf", str(listed), "--mesh", "2"], "holds a JSON list, not an object"))
    for argv, says in cases:
        assert main(["-q", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err, (argv, err)
