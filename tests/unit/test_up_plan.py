"""`ampd up --plan`: the deployment it starts is the planner's choice; bad use is a clear error."""
from __future__ import annotations

from ampd.cli import main
from ampd.config import Config
from ampd.launcher import plan_deployment
from ampd.planner import PlanRequest, plan
from ampd.slo import SLO
from ampd.workload import dump_trace, generate, load_trace


def test_up_plan_deploys_the_planners_choice(tmp_path):
    trace = tmp_path / "t.jsonl"
    dump_trace(generate("toolbench", 1.0, 60.0, 4)[:20], trace)
    cfg = Config.of(profile="qwen3-32b@h20", prefill="tp1*2", decode="tp1*2", ttft_slo=1.5, itl_slo=0.05)
    chosen, line = plan_deployment(cfg, str(trace), None)  # 4 GPUs: those of --prefill and --decode
    from ampd.perf import load_profile
    want = plan(PlanRequest(load_profile("qwen3-32b@h20"), load_trace(str(trace)), 4, SLO(1.5, 0.05), top=1)).top[0]
    flat = chosen.flat()
    assert (flat["prefill"], flat["decode"], flat["policy"]) == \
        (want.deployment.prefill_spec, want.deployment.decode_spec, want.policy)
    assert line.startswith(f"plan: prefill {want.deployment.prefill_spec} decode {want.deployment.decode_spec} ")
    assert "of 4 GPUs" in line
    assert (flat["ttft_slo"], flat["itl_slo"], flat["profile"]) == (1.5, 0.05, "qwen3-32b@h20")


def test_up_plan_errors_name_the_flag(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    dump_trace(generate("toolbench", 1.0, 10.0, 4)[:3], trace)
    assert main(["up", "--plan"]) == 2
    assert "ampd up: error: --plan: give the workload to plan for with --trace F" in capsys.readouterr().err
    assert main(["up", "--trace", str(trace)]) == 2
    assert "--trace: only with --plan" in capsys.readouterr().err
    assert main(["up", "--plan", "--trace", str(trace), "--profile", "llama3.1-70b@h20", "--gpus", "1"]) == 2
    err = capsys.readouterr().err
    assert "--gpus: 1 GPUs cannot hold one replica of llama3.1-70b@h20" in err and "Traceback" not in err
    assert main(["up", "--plan", "--trace", str(tmp_path / "none.jsonl")]) == 2
    assert "--trace:" in capsys.readouterr().err
