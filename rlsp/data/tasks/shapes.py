"""Synthetic visual task: shapes drawn with PIL, questions about their colour or count, answers checked by rule.

Each row is one image (`image_size` px square, white background) divided into a 3x3 grid; every shape sits in a
cell of its own (jittered by a few pixels), so shapes never overlap. Question kinds:
- "colour": one shape; "<image>what colour is the shape? answer with one word." -> "red" (one of `COLOURS`);
- "count": 1..`max_count` shapes of one colour and kind among 0..2 distractors (other colour or other kind);
  "<image>how many red squares are there? answer with a number." -> "3".
Prompts use lowercase ASCII only (rlsp's tiny character tokenizer has no capitals). Training rows draw the
answer uniformly first (as the arithmetic task does, so no answer dominates). Everything is drawn from one
`random.Random(seed)`: the same arguments write the same bytes.

Rows follow verl's multimodal layout: `data_source` ("rlsp/shapes"), `prompt` (chat messages with one `<image>`
placeholder), `images` ([{"bytes": PNG}]), `ability` ("vision"), `reward_model` ({"style": "rule",
"ground_truth"}), `extra_info` ({"split", "index", "kind", "colour", "shape", "count"}). The reward is
rlsp.rewards.shapes.

CLI: `python -m rlsp.data.tasks.shapes --out DIR [--n-train N --n-test M --kinds colour,count --seed S]`.
"""

from __future__ import annotations

import argparse
import io
import random
from typing import Any

from rlsp.data.tasks import write_splits_parquet

DATA_SOURCE = "rlsp/shapes"
COLOURS: dict[str, tuple[int, int, int]] = {"red": (220, 30, 30), "green": (30, 160, 60), "blue": (40, 70, 220),
                                            "yellow": (235, 200, 20)}
SHAPES = ("square", "circle", "triangle")
KINDS = ("colour", "count")
GRID = 3  # cells per side: at most 9 shapes, never overlapping
QUESTIONS = {"colour": "<image>what colour is the shape? answer with one word.",
             "count": "<image>how many {colour} {shape}s are there? answer with a number."}


def _draw(shapes: list[tuple[str, str]], size: int, rng: random.Random) -> bytes:
    """PNG bytes of `shapes` ((colour, kind) pairs), one per grid cell chosen at random."""
    from PIL import Image, ImageDraw  # noqa: PLC0415 -- PIL only where images are drawn

    image = Image.new("RGB", (size, size), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    cell = size // GRID
    side, slack = max(3, cell * 2 // 3), max(0, cell - max(3, cell * 2 // 3) - 1)
    for (colour, kind), slot in zip(shapes, rng.sample(range(GRID * GRID), len(shapes))):
        x0 = (slot % GRID) * cell + rng.randint(0, slack)
        y0 = (slot // GRID) * cell + rng.randint(0, slack)
        box = (x0, y0, x0 + side, y0 + side)
        fill = COLOURS[colour]
        if kind == "square":
            draw.rectangle(box, fill=fill)
        elif kind == "circle":
            draw.ellipse(box, fill=fill)
        else:
            draw.polygon([(x0 + side // 2, y0), (x0, y0 + side), (x0 + side, y0 + side)], fill=fill)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _distractor(colour: str, kind: str, rng: random.Random) -> tuple[str, str]:
    """A shape that is not (colour, kind): another colour, or another kind, or both."""
    while True:
        other = (rng.choice(list(COLOURS)), rng.choice(SHAPES))
        if other != (colour, kind):
            return other


def make_row(kind: str, answer: str, split: str, index: int, rng: random.Random, image_size: int = 48,
             max_count: int = 4) -> dict[str, Any]:
    """One row of question `kind` whose ground truth is `answer` (a colour name, or a count as a string)."""
    shape = rng.choice(SHAPES)
    if kind == "colour":
        colour, count, shapes = answer, 1, [(answer, shape)]
        question = QUESTIONS["colour"]
    else:
        colour, count = rng.choice(list(COLOURS)), int(answer)
        shapes = [(colour, shape)] * count
        shapes += [_distractor(colour, shape, rng) for _ in range(rng.randint(0, min(2, GRID * GRID - count)))]
        question = QUESTIONS["count"].format(colour=colour, shape=shape)
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": question}],
        "images": [{"bytes": _draw(shapes, image_size, rng)}],
        "ability": "vision",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index, "kind": kind, "colour": colour, "shape": shape,
                       "count": count},
    }


def _answers(kind: str, max_count: int) -> list[str]:
    return list(COLOURS) if kind == "colour" else [str(n) for n in range(1, max_count + 1)]


def _rows(n: int, kinds: tuple[str, ...], split: str, rng: random.Random, **shape: int) -> list[dict[str, Any]]:
    """`n` rows cycling over the kinds; per kind the answers cycle uniformly, reshuffled every pass."""
    rows: list[dict[str, Any]] = []
    pending: dict[str, list[str]] = {k: [] for k in kinds}
    while len(rows) < n:
        kind = kinds[len(rows) % len(kinds)]
        if not pending[kind]:
            pending[kind] = _answers(kind, shape.get("max_count", 4))
            rng.shuffle(pending[kind])
        rows.append(make_row(kind, pending[kind].pop(), split, len(rows), rng, **shape))
    return rows


def generate_shapes(n_train: int = 256, n_test: int = 16, seed: int = 0, kinds: tuple[str, ...] = ("colour",),
                    image_size: int = 48, max_count: int = 4) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train_rows, test_rows), deterministic in the arguments; see the module docstring."""
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise ValueError(f"kinds={kinds}: each must be one of {list(KINDS)}")
    if n_train < 1 or n_test < 1:
        raise ValueError(f"n_train={n_train}, n_test={n_test}: both must be >= 1")
    if not 1 <= max_count <= GRID * GRID:
        raise ValueError(f"max_count={max_count}: legal 1..{GRID * GRID} (one shape per cell of a {GRID}x{GRID} grid)")
    if image_size < 3 * GRID:
        raise ValueError(f"image_size={image_size}: legal >= {3 * GRID} px (shapes of at least 3 px per grid cell)")
    rng = random.Random(seed)
    shape = {"image_size": image_size, "max_count": max_count}
    return _rows(n_train, tuple(kinds), "train", rng, **shape), _rows(n_test, tuple(kinds), "test", rng, **shape)


def write_shapes_parquet(out_dir: str, **kwargs: Any) -> tuple[str, str]:
    """Write `train.parquet` and `test.parquet` under `out_dir`; kwargs go to `generate_shapes`."""
    return write_splits_parquet(out_dir, *generate_shapes(**kwargs))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Write the synthetic shapes task (images drawn with PIL) as verl-style "
                                "multimodal parquet.")
    p.add_argument("--out", required=True)
    p.add_argument("--n-train", type=int, default=256)
    p.add_argument("--n-test", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kinds", default="colour", help=f"comma-separated question kinds of {list(KINDS)}")
    p.add_argument("--image-size", type=int, default=48)
    p.add_argument("--max-count", type=int, default=4)
    args = p.parse_args(argv)
    train, test = write_shapes_parquet(args.out, n_train=args.n_train, n_test=args.n_test, seed=args.seed,
                                       kinds=tuple(args.kinds.split(",")), image_size=args.image_size,
                                       max_count=args.max_count)
    print(train)
    print(test)


if __name__ == "__main__":
    main()
