"""tools/training/train_demo.py and its parts: the static-shape training forward equals transformers' model, the turn
slots are independent, the data and labels are right, and a smoke run on CPU trains, saves and records its lineage."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import Qwen3VLMoeForConditionalGeneration

from vismmoe_edge.demo import TRAINED_DEMO_DIR
from vismmoe_edge.evaluation import shapes_vqa as sv
from vismmoe_edge.models.qwen3_vl_moe import load_qwen3_vl_processor as load_processor
from vismmoe_edge.prompt import build_messages

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "training"))

import leak_check as L  # noqa: E402
import train_data as D  # noqa: E402
import train_demo as T  # noqa: E402
import train_fast as F  # noqa: E402


@pytest.fixture(scope="module")
def demo() -> tuple[object, object, D.TurnEncoder, F.FastModel]:
    processor = load_processor(TRAINED_DEMO_DIR)
    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(str(TRAINED_DEMO_DIR), dtype=torch.float32).eval()
    encoder = D.TurnEncoder(processor)
    return processor, model, encoder, F.FastModel(model, encoder, torch.device("cpu"))


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).norm() / expected.norm()).item()


def pixels(scene: sv.Scene) -> torch.Tensor:
    return torch.from_numpy(np.array(sv.render(scene)))


def test_forward_equals_transformers_on_the_eval_prompt(demo) -> None:
    processor, model, encoder, fast = demo
    ex = sv.generate_split("test", 3, sv.SPLITS["test"][0])[2]
    text = processor.apply_chat_template(build_messages(ex.question, 1), tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=[sv.render(ex.scene)], return_tensors="pt")
    bucket = D.Bucket(ex.scene.width, ex.scene.height, 1, 1, 32, len(encoder.prefix))
    ids = encoder.ctx_ids(bucket.visual_tokens) + encoder.prompt_ids(ex.question)
    assert ids == inputs["input_ids"][0].tolist()  # the eval prompt's tokens, by the same split
    # patches as the processor makes them (one of its two identical temporal copies)
    patches = fast.patchify(pixels(ex.scene)[None])
    reference = inputs["pixel_values"].view(-1, 3, 2, 256)[:, :, 0].reshape(-1, 768)
    assert torch.allclose(patches, reference, atol=1e-6)
    c = fast.bucket_constants(bucket)
    positions, _ = model.model.get_rope_index(
        inputs["input_ids"], mm_token_type_ids=inputs["mm_token_type_ids"], image_grid_thw=inputs["image_grid_thw"]
    )
    assert torch.equal(c.positions[:, :, : len(ids)], positions)
    with torch.no_grad():
        expected = model(**inputs).logits[0, -1]
        padded = torch.full((1, bucket.seq_len), encoder.pad_id)
        padded[0, : len(ids)] = torch.tensor(ids)
        got = fast.logits(pixels(ex.scene)[None], padded, bucket)[0, len(encoder.prompt_ids(ex.question)) - 1]
    assert relative_error(got, expected) < 1e-5


def test_batched_vision_equals_per_image(demo) -> None:
    processor, model, encoder, fast = demo
    scenes = [sv.make_scene(random.Random(i), size=(512, 448)) for i in range(2)]
    batch = torch.stack([pixels(s) for s in scenes])
    bucket = D.Bucket(512, 448, 2, 1, 8, len(encoder.prefix))
    n = bucket.visual_tokens
    with torch.no_grad():
        merged, deepstack = fast.vision(batch, fast.bucket_constants(bucket))
        for i, scene in enumerate(scenes):
            inputs = processor.image_processor(images=[sv.render(scene)], return_tensors="pt")
            out = model.model.visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"])
            # float32 on the same weights, summed in another order: relative error of the tensor, not per element
            assert relative_error(merged[i * n : (i + 1) * n], out.pooler_output) < 1e-5
            for mine, theirs in zip(deepstack, out.deepstack_features, strict=True):
                assert relative_error(mine[i * n : (i + 1) * n], theirs) < 1e-5


def test_dense_experts_equal_the_sparse_loop() -> None:
    torch.manual_seed(0)
    processor = load_processor(TRAINED_DEMO_DIR)
    model = Qwen3VLMoeForConditionalGeneration(T.model_config(processor.tokenizer))
    moe = model.model.language_model.layers[0].mlp
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(37, 192, requires_grad=True)
    _, weights, index = moe.gate(x)
    weights = weights.detach()  # the router is transformers' own in both paths; compare the experts
    sparse = moe.experts(x, index, weights)
    grads_sparse = torch.autograd.grad(sparse.square().sum(), [x, moe.experts.gate_up_proj, moe.experts.down_proj])
    dense = F.dense_experts(moe.experts, x, index, weights)
    grads_dense = torch.autograd.grad(dense.square().sum(), [x, moe.experts.gate_up_proj, moe.experts.down_proj])
    assert torch.allclose(dense, sparse, atol=1e-5)
    for a, b in zip(grads_dense, grads_sparse, strict=True):
        assert torch.allclose(a, b, atol=1e-4)


def test_turn_slots_are_independent_eval_prompts(demo) -> None:
    """Each slot's answer logits are those of its question asked alone right after the image, whatever the other
    slots hold: no turn sees another turn."""
    _, _, encoder, fast = demo
    scene = sv.make_scene(random.Random(4), size=(448, 480))
    qas = [sv.QA("How many circles are there?", "1", "count"), sv.QA("What colour is the square?", "red", "color")]
    multi = D.Bucket(448, 480, 1, 2, 24, len(encoder.prefix))
    ids, targets, _ = D.encode_sample(encoder, multi, qas)
    single = D.Bucket(448, 480, 1, 1, 24, len(encoder.prefix))
    ids_second, _, _ = D.encode_sample(encoder, single, qas[1:])
    swapped = ids.clone()
    swapped[multi.ctx_len : multi.ctx_len + 24] = encoder.pad_id  # blank the first turn
    with torch.no_grad():
        both = fast.logits(pixels(scene)[None], ids[None], multi)[0]
        alone = fast.logits(pixels(scene)[None], ids_second[None], single)[0]
        blanked = fast.logits(pixels(scene)[None], swapped[None], multi)[0]
    assert torch.allclose(both[24:], alone, atol=1e-4)
    assert torch.allclose(both[24:], blanked[24:], atol=1e-4)
    # targets: the answer token at the prompt's last token, <|im_end|> after the answer, nothing else
    prompt = len(encoder.prompt_ids(qas[1].question))
    answer = encoder.tokenizer("red", add_special_tokens=False)["input_ids"]
    assert targets[24 + prompt - 1].item() == answer[0]
    assert targets[24 + prompt].item() == encoder.im_end
    assert (targets[24:] != D.IGNORE).sum().item() == 2


def test_greedy_answers_equal_transformers_generate(demo) -> None:
    processor, model, _, fast = demo
    examples = sv.generate_split("test", 8, sv.SPLITS["test"][0])
    got = F.greedy_answers(fast, [(e.scene, e.question) for e in examples], sv.render)
    eos = processor.tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    for e, answer in zip(examples, got, strict=True):
        text = processor.apply_chat_template(build_messages(e.question, 1), tokenize=False, add_generation_prompt=True)
        inputs = processor(text=[text], images=[sv.render(e.scene)], return_tensors="pt")
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False, eos_token_id=eos, pad_token_id=eos[1])
        expected = processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        assert answer == expected, e.id


def test_token_labels_object_mode() -> None:
    rng = random.Random(9)
    scene = next(s for s in (sv.make_scene(rng, size=(640, 640)) for _ in range(50)) if any(o.text for o in s.objects))
    image = np.asarray(sv.render(scene))
    cell_labels = D.token_labels(scene, image, "cell").reshape(20, 20, 4)
    object_labels = D.token_labels(scene, image, "object").reshape(20, 20, 4)
    assert object_labels[..., 3].sum() == len(scene.objects)  # one centre cell per object
    for obj in (o for o in scene.objects if o.text):
        row, col = (obj.y + obj.radius + 14) // 32, obj.x // 32  # a cell of the label's ink
        text_class = D.TEXT_CLASSES.index(obj.text) + 1
        assert cell_labels[row, col, 2] == object_labels[row, col, 2] == text_class
        # object mode: the label's cell also names its owner, and the body's cell what is written below it
        assert object_labels[row, col, 0] == list(sv.PALETTE).index(obj.color) + 1
        assert object_labels[obj.y // 32, obj.x // 32, 2] == text_class
        assert cell_labels[obj.y // 32, obj.x // 32, 2] == 0


def test_buckets_fit_the_token_budget() -> None:
    buckets = D.make_buckets((448, 1056), 100_000, 16, 24, 4)
    assert [(b.width, b.height) for b in buckets] == [(448, 448), (448, 1056), (1056, 448), (1056, 1056)]
    for b in buckets:
        assert b.batch % 8 == 0 and b.batch * b.seq_len <= 100_000
        assert b.seq_len == 4 + b.visual_tokens + 1 + 16 * 24


def test_batch_stream_shapes() -> None:
    processor = load_processor(TRAINED_DEMO_DIR)
    bucket = D.Bucket(448, 512, 2, 6, 24, len(D.TurnEncoder(processor).prefix))
    batch = D.BatchStream(D.StreamConfig(0, [bucket], background_reuse=2), processor).batch(random.Random(0), bucket)
    assert batch["images"].shape == (2, 512, 448, 3) and batch["images"].dtype == torch.uint8
    assert batch["ids"].shape == batch["real"].shape == (2, bucket.seq_len)
    assert batch["targets"].shape == (2, 6 * 24) and batch["token_labels"].shape == (2, bucket.visual_tokens, 4)
    assert ((batch["targets"] != D.IGNORE).sum(1) >= 2 * 4).all()  # several answered turns per image


def test_lr_schedule() -> None:
    assert T.lr_at(0, 100, 1e-3, 10, 0.1) == pytest.approx(1e-4)
    assert T.lr_at(9, 100, 1e-3, 10, 0.1) == pytest.approx(1e-3)
    assert T.lr_at(100, 100, 1e-3, 10, 0.1) == pytest.approx(1e-4)


def test_smoke_run_resumes_and_records_the_lineage(tmp_path: Path) -> None:
    out = tmp_path / "model"
    run = T.main([str(out), "--smoke", "--profile-json", str(tmp_path / "profile.json")])
    record = json.loads((out / "training.json").read_text())
    assert record["format"] == 2
    previous, this = record["runs"][:-1], record["runs"][-1]
    assert previous[0]["run"] == "attempt 6" and previous[0]["steps"] == 1535  # the shipped model's own run
    shipped = json.loads((TRAINED_DEMO_DIR / "training.json").read_text())["runs"]
    assert previous == shipped  # the shipped model's lineage is carried over whole
    assert this == json.loads(json.dumps(run)) and this["run"] == len(shipped) + 1
    assert this["steps"] == 2 and this["seed"] == 0 and this["data_version"] == D.DATA_VERSION
    assert this["resumed_from"]["init"] == str(TRAINED_DEMO_DIR)
    assert this["resumed_from"]["weights_sha256_16"] == T.weights_digest(TRAINED_DEMO_DIR)
    assert this["recipe"]["slots"] == 4 and this["recipe"]["init"] == str(TRAINED_DEMO_DIR)
    assert [e["step"] for e in this["log"]] == [1, 2] and all(np.isfinite(e["loss"]) for e in this["log"])
    assert this["gpu_quick_eval"]["test"]["counts"]["overall"] == 6
    assert sum(this["shards"].values()) <= T.MAX_BF16_BYTES
    assert json.loads((tmp_path / "profile.json").read_text())["throughput"]["phases"]["plain"]["steps"] == 2
    # the saved model is the shipped shape and loads as transformers' own class
    saved = Qwen3VLMoeForConditionalGeneration.from_pretrained(str(out))
    text = saved.config.text_config
    assert (text.num_hidden_layers, text.num_experts, text.num_experts_per_tok) == (8, 32, 4)
    assert T.weights_digest(out) != T.weights_digest(TRAINED_DEMO_DIR)  # it trained
    # a second run continues from the first and extends the lineage
    again = T.main([str(tmp_path / "again"), "--smoke", "--init", str(out)])
    assert again["run"] == len(shipped) + 2 and again["resumed_from"]["runs_before"] == len(shipped) + 1


def test_training_stream_holds_no_split_scene() -> None:
    """The leak check replays the real stream (two workers' first scenes here; the run's whole stream in
    docs/training/README.md) and finds no split scene, exact or by layout."""
    result = L.check(images=400, workers=2, seed=0, sides="448,1056", token_budget=20_000, split_n=200)
    assert result["training_scenes"] >= 400
    assert all(v == 0 for counts in result["matches"].values() for v in counts.values()), result
    # the keys do see a split scene, and its layout with other colours
    scene = sv.generate_example("test", 0, sv.SPLITS["test"][0]).scene
    objects = [sv.SceneObject(**{**vars(o), "color": "black"}) for o in scene.objects]
    recoloured = sv.Scene(**{**vars(scene), "objects": objects})
    exact, layout = L.split_keys(1)["test"]
    assert L.exact_key(scene) in exact and L.layout_key(recoloured) in layout
