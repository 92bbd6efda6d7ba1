"""adaptree vllm-bench's bookkeeping (adaptree.bench.vllm_bench), without vLLM: arm names, N-stream request sets,
the summary's ratios and output comparisons, and bad settings."""

import pytest

from adaptree.bench.vllm_bench import VllmBenchConfig, parse_arm, stream_requests, summarize_batches, table


def test_arm_names():
    assert parse_arm("vllm") == ("vllm", 0)
    assert parse_arm("vllm_eagle3:3") == ("vllm_eagle3", 3)
    assert parse_arm("adaptree_chain:2") == ("adaptree_chain", 2)
    for bad, why in (("vllm:2", "takes no K"), ("vllm_eagle3", "K must be"), ("vllm_eagle3:0", "K must be"),
                     ("eagle", "unknown arm 'eagle'")):
        with pytest.raises(ValueError, match=why):
            parse_arm(bad)
    with pytest.raises(ValueError, match="listed twice"):
        VllmBenchConfig(arms=["vllm", "vllm"])
    with pytest.raises(ValueError, match="streams must be positive"):
        VllmBenchConfig(streams=[0])
    with pytest.raises(ValueError, match="dtype must be bfloat16 or float32, got 'float16'"):
        VllmBenchConfig(dtype="float16")


def test_arm_configurations(tmp_path):
    """vLLM's own EAGLE-3 arm as vLLM configures it; adaptree's controlled arms keep every shared prefix-cache block
    (the drafter's holes are theirs to learn) and name their controller, radar and ltd with the policy next to the
    head."""
    from adaptree.bench.vllm_bench import vllm_arm
    from adaptree.models.assets import shipped_head

    head = str(shipped_head(None))
    fixed = vllm_arm("vllm_eagle3:2", "exported", None)
    assert fixed.adaptree is None and "disable_eagle_block_drop" not in fixed.spec
    ltd = vllm_arm("vllm_ltd:5", "exported", "costs.json", head)
    assert ltd.spec["disable_eagle_block_drop"] and ltd.spec["num_speculative_tokens"] == 5
    assert ltd.adaptree == {"controller": "ltd", "step_costs": "costs.json", "policy": f"{head}/ltd/depth"}
    assert vllm_arm("vllm_radar:3", "exported", "c.json", head).adaptree["policy"] == f"{head}/radar"
    assert vllm_arm("vllm_static-gs:3", "exported", "c.json").adaptree == {"controller": "static-gs",
                                                                              "step_costs": "c.json"}
    with pytest.raises(ValueError, match="needs a step-cost file"):
        vllm_arm("vllm_deagle:3", "exported", None)
    with pytest.raises(ValueError, match="needs an LTD depth policy"):
        vllm_arm("vllm_ltd:3", "exported", "c.json", str(tmp_path))


def test_n_streams_keep_n_busy_over_every_prompt():
    prompts = [[i] for i in range(6)]
    assert stream_requests(prompts, 1) == prompts
    assert stream_requests(prompts, 4) == prompts + prompts[:2]
    assert len(stream_requests(prompts, 16)) == 32 and stream_requests(prompts, 16)[6] == [0]


def _rec(arm, n, tokens, wall, outputs, drafts=0, accepted=0):
    return {"arm": arm, "streams": n, "batch": 0, "repeat": 0, "tokens": tokens, "wall_s": wall,
            "latencies_s": [wall] * len(outputs), "drafts": drafts, "draft_tokens": 2 * drafts,
            "accepted_tokens": accepted, "steps": 0, "outputs": outputs}


def test_summary_ratios_tau_and_differing_outputs():
    records = [_rec("vllm", 1, 100, 2.0, [[1, 2], [3]]), _rec("vllm_eagle3:2", 1, 100, 1.0, [[1, 2], [4]], 10, 5),
               _rec("vllm", 4, 400, 2.0, [[1]] * 4)]
    s = summarize_batches(records, ["vllm", "vllm_eagle3:2"], [1, 4])
    rows = {(r["arm"], r["streams"]): r for r in s["rows"]}
    assert rows[("vllm_eagle3:2", 1)]["vs_reference"] == pytest.approx(2.0)
    assert rows[("vllm_eagle3:2", 1)]["tau"] == pytest.approx(1.5)
    assert rows[("vllm_eagle3:2", 1)]["outputs_differing"] == 1
    assert rows[("vllm", 4)]["tokens_per_s"] == pytest.approx(200.0) and rows[("vllm", 4)]["tau"] is None
    assert ("vllm_eagle3:2", 4) not in rows
    assert "| vllm_eagle3:2 | 1 | 100.0 | 2.00x | 1.50 |" in table(s)
