"""gpt-oss on the CPU reference path against Hugging Face transformers' GptOssForCausalLM (float32).

A tiny random gpt-oss: four layers alternating a 12-token sliding window with full attention, attention
sinks, q/k/v/o biases, YaRN rope, 8 experts top-2 with biases and the clamped SwiGLU. 8-token blocks, each KV
group (full, sliding) with its own block table: prefill, decode well past the window, chunked prefill beside
decode rows while a block that slid out of the window is reused, a prefix hit whose sliding table starts with
null entries, and the engine's scheduler driving the worker on the layout it states. Each sampled row's logits
are compared with a full-sequence HF forward, which applies the windows and sinks itself.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ominix_runtime.contract import (
    AttentionKind,
    DecodeStep,
    NewRequestData,
    RunningRequestData,
)
from ominix_runtime.models import resolve_model
from ominix_worker.attention.ascend import AscendPagedAttention
from ominix_worker.loader import ModelLoadError, load_model
from ominix_worker.runner import build_runner
from ominix_worker.testing import write_tiny_hf_model

from .test_model_vs_hf import GREEDY, LogitsRecorder, Reference, assert_close, prompt, tokens_by_id
from .window_scenarios import (
    decode_past_the_window,
    prefix_hit_with_null_sliding_entries,
    scheduler_serves_the_layout,
)

WINDOW = 12
BS = 8
YARN = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 32,
    "rope_theta": 150000.0,
}
GPT_OSS = dict(
    arch="gpt_oss",
    num_layers=4,
    hidden_size=64,
    heads=4,
    kv_heads=2,
    intermediate_size=48,
    num_local_experts=8,
    num_experts_per_tok=2,
    sliding_window=WINDOW,
    rope_parameters=YARN,
    seed=21,
)


def eager_reference(folder: Path, **overrides: object) -> Reference:
    return Reference(folder, attn_implementation="eager", **overrides)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_hf_model(tmp_path_factory.mktemp("tiny_gpt_oss"), **GPT_OSS)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def pair(folder: Path) -> tuple[LogitsRecorder, Reference]:
    runner = build_runner(str(folder), num_blocks=64, block_size=BS)
    return LogitsRecorder(runner), eager_reference(folder)


def test_the_layout_alternates_sliding_and_full_layers(pair: tuple[LogitsRecorder, Reference]) -> None:
    rec, _ = pair
    layout = rec.runner.kv_layout()
    assert [g.kind for g in layout] == [AttentionKind.FULL, AttentionKind.SLIDING_WINDOW]
    assert layout[0].layer_indices == (1, 3) and layout[1].layer_indices == (0, 2)
    assert layout[1].sliding_window == WINDOW and rec.runner.max_model_len > WINDOW


def test_windows_and_sinks_change_the_reference(folder: Path, pair: tuple[LogitsRecorder, Reference]) -> None:
    """The comparisons below are meaningful: past the window, and without sinks, HF's logits differ."""
    _, ref = pair
    tokens = prompt(20, 40)
    windowed = ref.logits(tokens)
    full = eager_reference(folder, sliding_window=10_000).logits(tokens)
    assert ((windowed[-1] - full[-1]).abs().max() / windowed[-1].abs().max()).item() > 1e-2
    sinkless = eager_reference(folder)
    with torch.no_grad():
        for layer in sinkless.model.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
    no_sinks = sinkless.logits(tokens)
    assert ((windowed[-1] - no_sinks[-1]).abs().max() / windowed[-1].abs().max()).item() > 1e-2


def test_prefill_then_decode_past_the_window(pair: tuple[LogitsRecorder, Reference]) -> None:
    rec, ref = pair
    decode_past_the_window(rec, ref, [9, 2, 30], [[40, 7, 13]], last_step=31)  # 20 -> 50 tokens


def test_chunked_prefill_beside_decode_while_a_slid_out_block_is_reused(
    pair: tuple[LogitsRecorder, Reference],
) -> None:
    rec, ref = pair
    rec.runner.reset()
    long = prompt(22, 45)
    short = prompt(23, 6)
    result, logits = rec.step(
        DecodeStep(
            1,
            new_requests=[
                NewRequestData("long", long, GREEDY, [11, 5], 0, 13, 3, group_kv_block_ids=[[20, 21]]),
                NewRequestData("short", short, GREEDY, [40], 0, len(short), 4, group_kv_block_ids=[[41]]),
            ],
        )
    )
    assert set(logits) == {"short"}, "a chunked prefill must not sample"
    assert_close(logits["short"], ref.logits(short)[-1])
    short.append(tokens_by_id(result)["short"])
    result, logits = rec.step(
        DecodeStep(
            2,
            running_requests=[
                RunningRequestData("long", [12, 13], 19, new_group_kv_block_ids=[[22, 23]]),
                RunningRequestData("short", [], 1),
            ],
        )
    )
    assert_close(logits["short"], ref.logits(short)[-1])
    short.append(tokens_by_id(result)["short"])
    # 32 tokens computed: the sliding layers' next chunk reads from position 32 - 12 + 1 = 21, so sliding
    # blocks 20 and 21 (positions 0-15) left the window; the engine freed them and hands them to a new request
    # that writes them in this very step. The full layers keep every block.
    other = prompt(24, 9)
    result, logits = rec.step(
        DecodeStep(
            3,
            new_requests=[
                NewRequestData(
                    "other", other, GREEDY, [45, 46], 0, len(other), 5, group_kv_block_ids=[[20, 21]]
                )
            ],
            running_requests=[
                RunningRequestData("long", [14, 15], 13, new_group_kv_block_ids=[[24, 25]]),
                RunningRequestData("short", [], 1),
            ],
        )
    )
    assert_close(logits["long"], ref.logits(long)[-1])
    assert_close(logits["other"], ref.logits(other)[-1])
    assert_close(logits["short"], ref.logits(short)[-1])
    long.append(tokens_by_id(result)["long"])
    _, logits = rec.step(DecodeStep(4, running_requests=[RunningRequestData("long", [], 1)]))
    assert_close(logits["long"], ref.logits(long)[-1])


def test_prefix_hit_with_null_entries_in_the_sliding_table(pair: tuple[LogitsRecorder, Reference]) -> None:
    prefix_hit_with_null_sliding_entries(*pair)


def test_the_engine_scheduler_drives_the_worker_on_its_layout(
    folder: Path, pair: tuple[LogitsRecorder, Reference]
) -> None:
    scheduler_serves_the_layout(
        build_runner(str(folder), num_blocks=40, block_size=BS), "tiny-gpt-oss", pair[1]
    )


def test_dummy_weights_of_the_20b_shape_scaled_down(tmp_path: Path, folder: Path) -> None:
    """dummy:CONFIG builds gpt-oss with random weights (every parameter drawn, finite logits)."""
    config = (folder / "config.json").read_text()
    (tmp_path / "config.json").write_text(config)
    runner = build_runner(f"dummy:{tmp_path / 'config.json'}", num_blocks=16, block_size=BS)
    result = runner.execute_step(
        DecodeStep(
            1,
            new_requests=[
                NewRequestData(
                    "d", prompt(5, 20), GREEDY, [0, 1, 2], 0, 20, 1, group_kv_block_ids=[[0, 1, 2]]
                )
            ],
        )
    )
    assert result.outputs[0].error_kind is None and result.outputs[0].sampled_token_id is not None
    sinks = runner.model.layers[0].self_attn.sinks
    assert torch.isfinite(sinks).all() and sinks.abs().sum() > 0


def test_what_gpt_oss_cannot_run_is_refused(folder: Path) -> None:
    source = resolve_model(str(folder))
    with pytest.raises(ModelLoadError, match="no attention sinks"):
        load_model(source, torch.device("cpu"), torch.float32, AscendPagedAttention(ops=object()))  # type: ignore[arg-type]
    with pytest.raises(ModelLoadError, match="FP8"):
        load_model(
            source,
            torch.device("cpu"),
            torch.float32,
            build_runner(str(folder), num_blocks=4).backend,
            quantization="fp8",
        )


def test_an_fp8_checkpoint_is_refused_clearly(folder: Path, tmp_path: Path) -> None:
    """A gpt-oss checkpoint stating FP8 quantization is a ModelLoadError saying so, on the CPU and on any other
    device (meta stands in for a GPU: the refusal comes before the device is used), not a TypeError from the
    experts' FP8 hook."""
    from ominix_worker.attention.torch_ref import TorchReferenceAttention

    fp8 = tmp_path / "fp8"
    shutil.copytree(folder, fp8)
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 16],
    }  # fmt: skip
    (fp8 / "config.json").write_text(json.dumps(config))
    for device in ("cpu", "meta"):
        with pytest.raises(ModelLoadError, match="FP8 gpt-oss checkpoints are not supported"):
            load_model(
                resolve_model(str(fp8)), torch.device(device), torch.float32, TorchReferenceAttention()
            )


def test_tensor_parallelism_is_refused(folder: Path) -> None:
    from ominix_worker.attention.torch_ref import TorchReferenceAttention
    from ominix_worker.parallel import TensorParallel

    tp = TensorParallel(rank=0, size=2, group=object())  # type: ignore[arg-type]  # refused before any collective
    with pytest.raises(ModelLoadError, match="one rank"):
        load_model(
            resolve_model(str(folder)), torch.device("cpu"), torch.float32, TorchReferenceAttention(), tp=tp
        )
