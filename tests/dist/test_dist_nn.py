"""coconet.nn's tensor-parallel layers on 2 and 4 ranks equal torch.nn on one process: outputs,
input, weight and bias gradients, dropout masks, three SGD steps of an MLP, inference, and
sequence parallel (uneven features and tokens). Float32 to 1e-5 relative (the all_reduce adds
the ranks' partial products in another order than one matmul does).
"""

from __future__ import annotations

import pytest
from support import nn_workers

from coconet.runtime import CommOptions, spawn

OPTIONS = CommOptions(timeout=60)


def _assert_within(results: list[dict[str, float]], rtol: float = 1e-5) -> None:
    """Every rank's every error (relative to its reference) at most ``rtol``."""
    for rank, errors in enumerate(results):
        bad = {k: v for k, v in errors.items() if not v <= rtol}
        assert bad == {}, f"rank {rank}: {bad}"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("nproc", [2, 4])
def test_layers_equal_torch(nproc):
    results = spawn(nn_workers.layers_vs_torch, nproc, options=OPTIONS, timeout=220)
    _assert_within(results)


@pytest.mark.timeout(180)
def test_sequence_parallel_equals_torch():
    results = spawn(nn_workers.sequence_parallel_vs_torch, 2, options=OPTIONS, timeout=160)
    _assert_within(results)


@pytest.mark.timeout(180)
def test_attention_and_decoding_equal_torch():
    results = spawn(nn_workers.attention_vs_torch, 2, options=OPTIONS, timeout=160)
    _assert_within(results)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("plan", ["mlp", "block"])
def test_parallelize_a_nanogpt_model(plan):
    """nanoGPT-style GPT, its MLPs (and its attention) swapped by name, AdamW for 4 steps: the
    losses and every weight follow one process."""
    results = spawn(nn_workers.parallelized_gpt_vs_torch, 2, 4, plan, options=OPTIONS,
                    timeout=160)  # fmt: skip
    _assert_within(results)


@pytest.mark.timeout(240)
def test_a_hugging_face_llama_runs_with_its_own_plan_and_generate():
    """transformers' Llama (grouped key/value heads), parallelized by its own tp_plan: its
    logits follow one process, its own generate() gives the same tokens, the embedding stays
    whole (said), and what cannot run is refused, on every rank."""
    for rank, out in enumerate(spawn(nn_workers.hf_llama_generate, 2, options=OPTIONS,
                                     timeout=220)):  # fmt: skip
        assert out["swapped"] == ["ColumnParallelLinear", "RowParallelLinear"], out["swapped"]
        assert out["left whole"] == {"model.embed_tokens": "embedding_rowwise"}, out
        assert out["logits"] <= 1e-5, (rank, out["logits"])
        assert out["tokens"] == (48, 48), (rank, out["tokens"])
        refusals = out["refusals"]
        assert "num_attention_heads = 3 does not divide over the 2 ranks" in refusals["heads"]
        assert "gate_proj: packed_colwise" in refusals["style"], refusals["style"]
        assert "Sequential has no tensor-parallel plan of its own" in refusals["no plan"]


@pytest.mark.timeout(240)
def test_paper_schedules_of_the_layers_equal_torch():
    """MM_AR_C, MM_RS_C_AG and ol_MM_fuse_RS_C_AG on the row-parallel forward and on the
    column-parallel backward, eager kernels."""
    results = spawn(nn_workers.schedules_vs_torch, 2, options=OPTIONS, timeout=220)
    _assert_within(results)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tokens,transport", [(7, "shared memory"), (9, "torch.distributed"),
                                              (3, "shared memory")])
def test_sequence_parallel_schedules_equal_torch(tokens, transport):
    """ol_AG_MM, ol_MM_RS_C, ol_sequence_parallel and auto on a sequence-parallel MLP (dropout,
    residual), uneven tokens (3: fewer rows per rank than chunks), both transports."""
    options = CommOptions(timeout=60, transport=transport)
    results = spawn(nn_workers.sequence_parallel_schedules_vs_torch, 2, tokens, options=options,
                    timeout=280)  # fmt: skip
    _assert_within(results)


@pytest.mark.timeout(300)
def test_torch_compile_of_a_model_holding_layers():
    results = spawn(nn_workers.compiled_model_vs_torch, 2, options=OPTIONS, timeout=280)
    _assert_within(results)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", ["torch.distributed", "shared memory"])
def test_a_rank_killed_in_backward(transport):
    from coconet.runtime import RankFailure

    options = CommOptions(timeout=30, transport=transport)
    survivor, victim = spawn(nn_workers.killed_in_backward, 2, 1, options=options, timeout=80,
                             failures="return")  # fmt: skip
    assert isinstance(victim, RankFailure)
    assert survivor["status"] == "fault", survivor
    assert "a peer rank died" in survivor["message"]
    assert survivor["seconds"] < 15
    assert survivor["unchanged"]


@pytest.mark.timeout(300)
def test_auto_schedule_equals_torch():
    results = spawn(nn_workers.auto_schedule_vs_torch, 2, options=OPTIONS, timeout=280)
    _assert_within(results)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("nproc", [2, 4])
def test_attention_dropout_equals_one_process_with_the_same_masks(nproc):
    """A nanoGPT attention's dropouts carried over by parallelize (flash and slow paths): train
    mode equals one process with coconet's masks, however the heads are split; eval mode equals
    the module; a GPT's train-mode losses equal one process's and differ from no dropout."""
    results = spawn(nn_workers.attention_dropout_vs_reference, nproc, options=OPTIONS,
                    timeout=160)  # fmt: skip
    _assert_within(results)


@pytest.mark.timeout(120)
def test_parallelize_refuses_ranks_whose_torch_generators_differ():
    """The model keeps dropouts of its own (nanoGPT's MLP and embedding dropouts): every rank
    refuses when torch is seeded per rank, and accepts when seeded alike."""
    results = spawn(nn_workers.refusals_of_dropouts, 2, options=OPTIONS, timeout=100)
    for seen in results:
        assert seen["alike"] == "accepted"
        refused = seen["per-rank seeds"]
        assert "differs between the ranks of the group: ranks [1]" in refused, refused
        assert "transformer.drop" in refused and "torch.manual_seed(seed)" in refused


@pytest.mark.timeout(180)
def test_deepcopy_and_torch_save_of_a_parallelized_model(tmp_path):
    """copy.deepcopy shares the group and trains like the original; torch.save -> torch.load ->
    coconet.nn.attach gives the same losses and gradient norm; before attach: a ConfigError."""
    results = spawn(nn_workers.copies_and_saves, 2, str(tmp_path), options=OPTIONS, timeout=160)
    _assert_within(results, rtol=0.0)
