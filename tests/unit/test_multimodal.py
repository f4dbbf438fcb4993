"""Image rows (rlsp.data.multimodal, rlsp.data.vision_processor): the model's processor read back from its files
(without torchvision too), rows rendered exactly as the processor renders them, image tokens counted in every
prompt length, and every bad input refused by name (file, row, key, what is legal)."""

from __future__ import annotations

import io

import pandas as pd
import pytest
import torch
from PIL import Image

from rlsp.data.dataset import PromptDataset, prompt_report
from rlsp.data.multimodal import IMAGE_PLACEHOLDER, Where, decode_images, multimodal_meta, vision_prompt
from rlsp.data.vision_processor import has_torchvision, load_processor
from rlsp.models.tiny_vl import MERGE, write_tiny_vl_dir

KEY = "actor_rollout_ref.model.path"


def _png(size: tuple[int, int], colour: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, format="PNG")
    return out.getvalue()


def _row(content: str, images: list | None, i: int = 0) -> dict:
    row = {"data_source": "rlsp/shapes", "prompt": [{"role": "user", "content": content}],
           "reward_model": {"style": "rule", "ground_truth": "red"}, "extra_info": {"index": i}}
    if images is not None:
        row["images"] = images
    return row


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory) -> str:
    return write_tiny_vl_dir(str(tmp_path_factory.mktemp("tiny_vl")))


@pytest.fixture(scope="module")
def processor(vl_dir):
    return load_processor(KEY, vl_dir)


def test_the_processor_is_read_back_from_its_files(processor):
    tokenizer = processor.tokenizer
    assert processor.image_token_id == tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert type(processor.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    assert processor.image_processor.patch_size == 4 and processor.image_processor.merge_size == MERGE
    if not has_torchvision():  # transformers cannot build the Qwen-VL processor here: its image-only form
        assert type(processor).__name__ == "Qwen2_5_VLProcessorImageOnly"


def test_rendering_equals_the_processor_on_the_same_messages(processor):
    images = [Image.open(io.BytesIO(_png((40, 24)))), Image.open(io.BytesIO(_png((16, 16), (0, 0, 200))))]
    messages = [{"role": "system", "content": "be brief."},
                {"role": "user", "content": f"{IMAGE_PLACEHOLDER}left, {IMAGE_PLACEHOLDER}right: same colour?"}]
    got = vision_prompt(messages, images, processor, Where("f.parquet", 3))
    parts = [{"type": "image"}, {"type": "text", "text": "left, "}, {"type": "image"},
             {"type": "text", "text": "right: same colour?"}]
    text = processor.apply_chat_template([messages[0], {"role": "user", "content": parts}], tokenize=False,
                                         add_generation_prompt=True)
    want = processor(text=[text], images=images, return_tensors="pt")
    assert got["prompt_text"] == text
    assert got["prompt_ids"] == want["input_ids"][0].tolist()
    mm = got["multi_modal_inputs"]
    assert torch.equal(mm["pixel_values"], want["pixel_values"]) and mm["pixel_values"].dtype == torch.float32
    assert torch.equal(mm["image_grid_thw"], want["image_grid_thw"]) and mm["image_grid_thw"].dtype == torch.long
    alone = processor.image_processor(images, return_tensors="pt")  # the image processor by itself agrees
    assert torch.equal(mm["pixel_values"], alone["pixel_values"])
    per_image = (mm["image_grid_thw"].prod(dim=1) // MERGE**2).tolist()
    assert mm["pixel_values"].shape[0] == int(mm["image_grid_thw"].prod(dim=1).sum())
    assert got["prompt_ids"].count(processor.image_token_id) == sum(per_image)
    assert per_image == [15, 4]  # 40x24 -> 40x24 (multiples of 8): 5x3 tokens; 16x16: 2x2
    no_image = vision_prompt([{"role": "user", "content": "hi"}], [], processor, Where("f", 0))
    assert no_image["multi_modal_inputs"] is None
    assert no_image["prompt_ids"] == processor.tokenizer.encode(no_image["prompt_text"], add_special_tokens=False)


def _write(tmp_path, rows: list[dict], name: str = "d.parquet") -> str:
    path = tmp_path / name
    pd.DataFrame(rows).to_parquet(path)
    return str(path)


def test_dataset_rows_carry_expanded_ids_pixels_and_bytes(tmp_path, vl_dir, processor):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "b.png").write_bytes(_png((32, 32)))
    big, small = _png((32, 32)), _png((8, 8))
    rows = [_row(f"{IMAGE_PLACEHOLDER}colour?", [{"bytes": big, "path": None}], 0),
            _row(f"{IMAGE_PLACEHOLDER}colour?", [{"bytes": None, "path": "img/b.png"}], 1),
            _row(f"{IMAGE_PLACEHOLDER}colour?", [{"bytes": small, "path": None}], 2), _row("hi", [], 3)]
    path = _write(tmp_path, rows)
    ds = PromptDataset(path, processor.tokenizer, max_prompt_length=200, processor=processor)
    assert [it["image_tokens"] for it in ds.items] == [16, 16, 1, 0]
    assert ds.items[0]["images"] == [big] and ds.items[2]["images"] == [small] and ds.items[3]["images"] == []
    assert ds.items[3]["multi_modal_inputs"] is None
    assert torch.equal(ds.items[0]["multi_modal_inputs"]["pixel_values"], ds.items[1]["multi_modal_inputs"]["pixel_values"])
    meta = multimodal_meta(ds.items)
    assert meta["images"][1] == [(tmp_path / "img" / "b.png").read_bytes()] and meta["multi_modal_inputs"][3] is None
    lengths = [len(it["prompt_ids"]) for it in ds.items]
    limit = lengths[2]  # the 16-image-token rows are over it, the 1-token row is not: image tokens are counted
    kept = PromptDataset(path, processor.tokenizer, max_prompt_length=limit, filter_overlong=True)  # reads vl_dir's
    assert [it["extra_info"]["index"] for it in kept.items] == [2, 3]
    report = prompt_report([path], processor.tokenizer)
    assert report.lengths == lengths and report.image_tokens == [16, 16, 1, 0] and report.overlong(limit) == 2
    with pytest.raises(ValueError, match=r"row 0: truncating its \d+ prompt tokens to \d+ cuts \d+ of its 16 image"):
        PromptDataset(path, processor.tokenizer, max_prompt_length=limit, filter_overlong=False, truncation="left")


def test_text_only_files_render_as_before(tmp_path, processor):
    path = _write(tmp_path, [_row("1+1=", None)])
    item = PromptDataset(path, processor.tokenizer, max_prompt_length=64, processor=processor).items[0]
    text = processor.tokenizer.apply_chat_template(item["messages"], tokenize=False, add_generation_prompt=True)
    assert item["prompt_ids"] == processor.tokenizer.encode(text, add_special_tokens=False)
    assert "multi_modal_inputs" not in item and multimodal_meta([item]) == {}


@pytest.mark.parametrize(("content", "images", "needle"), [
    (f"{IMAGE_PLACEHOLDER}{IMAGE_PLACEHOLDER}two?", "one", r"the prompt has 2 <image> placeholder\(s\) and the row 1 image"),
    ("none?", "one", r"the prompt has 0 <image> placeholder\(s\) and the row 1 image"),
    (f"{IMAGE_PLACEHOLDER}?", "bad", r"image 0: unreadable \(12 bytes"),
    (f"{IMAGE_PLACEHOLDER}?", "missing", r"image 0: file '.*nowhere.png' not found; legal image forms"),
    (f"{IMAGE_PLACEHOLDER}?", "number", r"image 0: int '7' is no image; legal image forms"),
    (f"{IMAGE_PLACEHOLDER}?", "zero", r"image 0: unreadable \(65 bytes"),  # PIL refuses a 0x0 header itself
    (f"{IMAGE_PLACEHOLDER}?", "empty", r"image 0: empty \(no bytes, no path\)"),
])
def test_bad_rows_are_refused_by_file_row_and_key(tmp_path, processor, content, images, needle):
    value = {"one": [_png((8, 8))], "bad": [b"not an image"], "missing": ["nowhere.png"], "number": [7],
             "zero": [_zero_png()], "empty": [{"bytes": b"", "path": None}]}[images]
    path = _write(tmp_path, [_row("fine", []), _row(content, value, 1)])
    with pytest.raises(ValueError, match=rf"d.parquet row 1 column 'images'(: | ){needle}"):
        PromptDataset(path, processor.tokenizer, max_prompt_length=200, processor=processor)
    report = prompt_report([path], processor.tokenizer, processor=processor)  # rlsp.check lists it, row by row
    assert len(report.problems) == 1 and "row 1" in report.problems[0] and report.lengths


def _zero_png() -> bytes:
    """A PNG whose header says 0x0 (PIL writes none; a real file can)."""
    import struct  # noqa: PLC0415
    import zlib  # noqa: PLC0415

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", 0, 0, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def test_videos_and_text_only_models_are_refused(tmp_path, processor):
    rows = [_row(f"{IMAGE_PLACEHOLDER}?", [_png((8, 8))])]
    rows[0]["videos"] = [{"bytes": b"frames"}]
    path = _write(tmp_path, rows, "v.parquet")
    why = "needs torchvision" if not has_torchvision() else "images only"
    with pytest.raises(ValueError, match=rf"v.parquet: column 'videos' \(data.video_key\) holds videos; .*{why}"):
        PromptDataset(path, processor.tokenizer, max_prompt_length=200, processor=processor)
    with pytest.raises(ValueError, match=r"d.parquet row 0 column 'images': a prompt with images needs data.apply_chat_template=true"):
        completion = {**_row("", [_png((8, 8))]), "prompt": f"{IMAGE_PLACEHOLDER}?"}  # a string, no template
        PromptDataset(_write(tmp_path, [completion]), processor.tokenizer, max_prompt_length=200, chat_template=False,
                      processor=processor)
    (tmp_path / "text_model").mkdir()
    with pytest.raises(ValueError, match=rf"{KEY}='.*text_model' has no preprocessor_config.json: no image processor"):
        load_processor(KEY, str(tmp_path / "text_model"))
    assert decode_images(None, ".", Where("f", 0)) == ([], [])
    (tmp_path / "a.png").write_bytes(_png((8, 8)))
    images, raw = decode_images([_png((5, 3)), "a.png"], str(tmp_path), Where("f", 0))  # raw bytes, relative path
    assert [im.size for im in images] == [(5, 3), (8, 8)] and raw[1] == (tmp_path / "a.png").read_bytes()


def test_rows_feed_transformers_own_vision_language_model(tmp_path, vl_dir, processor):
    """The row format is what the model takes: transformers' Qwen2.5-VL scatters one feature per image token."""
    from transformers import AutoConfig, AutoModelForImageTextToText  # noqa: PLC0415

    rows = [_row(f"{IMAGE_PLACEHOLDER}and {IMAGE_PLACEHOLDER}?", [{"bytes": _png((24, 16)), "path": None},
                                                                  {"bytes": _png((8, 8)), "path": None}])]
    item = PromptDataset(_write(tmp_path, rows), processor.tokenizer, max_prompt_length=200).items[0]
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(vl_dir)).eval()
    ids = torch.tensor([item["prompt_ids"]])
    with torch.no_grad():
        out = model(input_ids=ids, **item["multi_modal_inputs"])
        text_only = model(input_ids=ids)  # the same ids without pixels: image positions hold the pad embedding
    assert out.logits.shape == (1, len(item["prompt_ids"]), model.config.text_config.vocab_size)
    assert torch.isfinite(out.logits).all()
    first_image = item["prompt_ids"].index(processor.image_token_id)
    assert torch.equal(out.logits[0, :first_image], text_only.logits[0, :first_image])  # causal: before any image
    assert not torch.allclose(out.logits[0, first_image:], text_only.logits[0, first_image:])
