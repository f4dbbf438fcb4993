"""Geometry3K (hiyouga/geometry3k) records as verl's geo3k rows (`python -m rlsp.data.preprocess geo3k`).

Input records, as the Hub's export has them: `problem` (text with an `<image>` placeholder), `answer` (e.g.
"3", "2\\sqrt{3}") and `images` (a list of images: {"bytes", "path"} structs in parquet, raw bytes, or file
paths relative to the input file). Output rows (verl's examples/data_preprocess/geo3k.py layout):
- `data_source`: "hiyouga/geometry3k" (selects rlsp.rewards.geo3k);
- `prompt`: [{"role": "user", "content": problem + " " + `GEO3K_INSTRUCTION`}];
- `images`: [{"bytes": ...}] per image, checked to decode (rlsp.data.multimodal.decode_images);
- `ability`: "math"; `reward_model`: {"style": "rule", "ground_truth": answer};
- `extra_info`: {"split", "index", "answer", "question"}.
"""

from __future__ import annotations

from typing import Any

from rlsp.data.multimodal import IMAGE_PLACEHOLDER, Where, decode_images

GEO3K_SOURCE = "hiyouga/geometry3k"
GEO3K_INSTRUCTION = ("You FIRST think about the reasoning process as an internal monologue and then provide the final "
                     "answer. The reasoning process MUST BE enclosed within <think> </think> tags. The final answer "
                     "MUST BE put in \\boxed{}.")


def geo3k_row(record: dict[str, Any], split: str, index: int, base_dir: str = ".", file: str = "input") -> dict[str, Any]:
    """One geo3k record as a verl row; ValueError naming the record and what is missing or unreadable."""
    missing = [k for k in ("problem", "answer", "images") if k not in record]
    if missing:
        raise ValueError(f"geo3k record {index} lacks {missing}; it has {sorted(record)} (expected ['problem', "
                         "'answer', 'images'])")
    images = record["images"]
    images = list(images.tolist() if hasattr(images, "tolist") else images) if images is not None else []
    _, raw = decode_images(images, base_dir, Where(file, index))
    problem = str(record["problem"])
    if problem.count(IMAGE_PLACEHOLDER) != len(raw):
        raise ValueError(f"{Where(file, index)}: the problem has {problem.count(IMAGE_PLACEHOLDER)} "
                         f"{IMAGE_PLACEHOLDER} placeholder(s) and the record {len(raw)} image(s); legal: one each")
    return {
        "data_source": GEO3K_SOURCE,
        "prompt": [{"role": "user", "content": f"{problem} {GEO3K_INSTRUCTION}"}],
        "images": [{"bytes": data} for data in raw],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(record["answer"])},
        "extra_info": {"split": split, "index": index, "answer": str(record["answer"]), "question": problem},
    }
