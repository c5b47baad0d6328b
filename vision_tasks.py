"""vision_toy's tasks (`python data_prep.py vision_toy`): seeded synthetic questions on images where code on the image
helps, each with an exact answer and the box of the image that holds it (data_prep.py turns them into rows; rewards.py's
tool rule looks for that box in the crops the agent returns). Each task function takes a random.Random and the image
side, and returns {"image": PNG bytes, "question", "answer", "box": [x0, y0, x1, y1]}.
"""
from __future__ import annotations

import csv
import functools
import io
import math
import random
from pathlib import Path

import matplotlib
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.transforms import Bbox
from PIL import Image, ImageDraw, ImageFont

DOT_COLOURS = {"red": (220, 30, 30), "green": (20, 150, 50), "blue": (30, 60, 220), "orange": (250, 140, 0)}
CODE_ALPHABET = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"  # no 0/O, 1/I: a crop must make the code readable, not guessable
MSFT_CSV = Path(matplotlib.get_data_path()) / "sample_data" / "msft.csv"


def _png(picture: Image.Image) -> bytes:
    buf = io.BytesIO()
    picture.save(buf, format="PNG")
    return buf.getvalue()


def _dots_task(rng: random.Random, size: int) -> dict:
    """Non-overlapping dots of several colours (not antialiased: each is one solid colour); how many of one colour."""
    picture = Image.new("RGB", (size, size), "white")
    draw, placed = ImageDraw.Draw(picture), []
    colour = rng.choice(list(DOT_COLOURS))
    for name in DOT_COLOURS:
        for _ in range(rng.randint(1, 9)):
            for _ in range(100):  # a free spot; a crowded canvas just gets fewer dots of this colour
                r = rng.randint(max(3, size // 150), max(5, size // 80))
                x, y = rng.randint(r + 2, size - r - 3), rng.randint(r + 2, size - r - 3)
                if all((x - a) ** 2 + (y - b) ** 2 > (r + c + 4) ** 2 for a, b, c, _ in placed):
                    placed.append((x, y, r, name))
                    draw.ellipse((x - r, y - r, x + r, y + r), fill=DOT_COLOURS[name])
                    break
    mine = [(x, y, r) for x, y, r, name in placed if name == colour]
    box = [min(x - r for x, _, r in mine), min(y - r for _, y, r in mine),
           max(x + r for x, _, r in mine) + 1, max(y + r for _, y, r in mine) + 1]
    return {"image": _png(picture), "question": f"How many {colour} dots are in the image? Answer with a number.",
            "answer": str(len(mine)), "box": box}


def _tiny_text_task(rng: random.Random, size: int) -> dict:
    """A 4-character code in small black text somewhere among grey shapes: unreadable unless cropped and zoomed."""
    picture = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(picture)
    for _ in range(12):
        x, y, w, h = rng.randrange(size), rng.randrange(size), rng.randint(8, size // 4), rng.randint(8, size // 4)
        draw.rectangle((x, y, x + w, y + h), fill=(rng.randint(170, 235),) * 3)
    code = "".join(rng.choice(CODE_ALPHABET) for _ in range(4))
    font = ImageFont.load_default(size=10)
    left, top, right, bottom = draw.textbbox((0, 0), code, font=font)
    x, y = rng.randint(4, size - right - 5), rng.randint(4, size - bottom - 5)
    draw.rectangle((x + left - 3, y + top - 3, x + right + 2, y + bottom + 2), fill="white")
    draw.text((x, y), code, fill="black", font=font)
    return {"image": _png(picture), "answer": code, "box": [x + left, y + top, x + right, y + bottom],
            "question": "A code of 4 capital letters and digits is written in tiny black text somewhere in the image. "
                        "What is the code?"}


@functools.lru_cache(maxsize=1)
def _msft_closes() -> list[tuple[str, float]]:
    """(date, close) of matplotlib's bundled MSFT sample, oldest first."""
    with open(MSFT_CSV, newline="") as f:
        return [(r["Date"], float(r["Close"])) for r in csv.DictReader(f)][::-1]


def _chart_task(rng: random.Random, size: int) -> dict:
    """A bar chart of 5-8 consecutive closes of the MSFT sample with small value labels; the question asks for the
    date of the highest or lowest close, or the close on a date (two decimals, as labelled)."""
    closes = _msft_closes()
    n = rng.randint(5, 8)
    start = rng.randrange(len(closes) - n)
    window = closes[start:start + n]
    values = [v for _, v in window]
    kind = rng.choice(("highest", "lowest", "value"))
    pick = values.index(max(values)) if kind == "highest" else values.index(min(values)) if kind == "lowest" \
        else rng.randrange(n)
    if kind != "value" and values.count(values[pick]) > 1:
        return _chart_task(rng, size)  # a tie has no single date
    figure = Figure(figsize=(size / 100, size * 0.75 / 100), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    bars = axes.bar(range(n), values, color="tab:blue")
    labels = axes.bar_label(bars, labels=[f"{v:.2f}" for v in values], fontsize=5)
    axes.set_xticks(range(n), [d for d, _ in window], fontsize=6, rotation=30)
    axes.set_ylim(min(values) * 0.9, max(values) * 1.05)
    axes.set_title("Microsoft closing price (USD)")
    figure.canvas.draw()
    width, height = figure.canvas.get_width_height()
    bar = Bbox.intersection(bars[pick].get_window_extent(), axes.get_window_extent())  # the bar's part above ylim
    extent = Bbox.union([bar, labels[pick].get_window_extent(), axes.get_xticklabels()[pick].get_window_extent()])
    box = [max(0, math.floor(extent.x0)), max(0, math.floor(height - extent.y1)), min(width, math.ceil(extent.x1)),
           min(height, math.ceil(height - extent.y0))]
    buf = io.BytesIO()
    figure.savefig(buf, format="png", metadata={"Software": None})
    date, value = window[pick]
    question = (f"On which date was the closing price {kind}? Answer with the date as labelled." if kind != "value"
                else f"What was the closing price on {date}? Answer with two decimals.")
    return {"image": buf.getvalue(), "question": question, "answer": f"{value:.2f}" if kind == "value" else date,
            "box": box}


TASKS = {"dots": _dots_task, "text": _tiny_text_task, "chart": _chart_task}
FAMILIES = tuple(TASKS)


# `make demo-vision`'s counting tasks: solid squares of COUNT_SIDE px in COUNT_COLOURS; the question names 1-3 colours
# and asks how many squares have one of them. A tiny vision-language model cannot count pixels by looking: one
# correct program on the image does (its colours exactly, the mask's area over a square's).
COUNT_SIDE = 5
COUNT_COLOURS = DOT_COLOURS | {"purple": (140, 40, 160), "yellow": (230, 200, 20)}  # six: many 3-colour sequences
COUNT_QUESTION = "How many squares are {colours}? Answer with a number."
# The careless teacher's colour test (data_prep.vision_count_teacher_conversations): one channel over a threshold,
# which the white background passes too, so a program with it counts wrong whatever the image.
COUNT_SLIPS = {"red": "(a[:, :, 0] > 200)", "green": "(a[:, :, 1] > 100)", "blue": "(a[:, :, 2] > 200)",
               "orange": "(a[:, :, 0] > 240)", "purple": "(a[:, :, 2] > 150)", "yellow": "(a[:, :, 1] > 180)"}


def colour_test(colour: str) -> str:
    """The exact test for one colour's pixels in the program's array `a`."""
    return f"(a == {COUNT_COLOURS[colour]}).all(2)"


def count_code(colours: list[str], tests: list[str]) -> str:
    """The program that counts the squares passing any of the pixel `tests` (one per colour, in a variable named by
    it) and shows their mask."""
    lines = [f"{colour} = {test}" for colour, test in zip(colours, tests)]
    return "\n".join(["import numpy as np", "from PIL import Image", "a = np.array(image)", *lines,
                      f"m = {' | '.join(colours)}", "Image.fromarray(m).show()", f"print(m.sum() // {COUNT_SIDE ** 2})"])


def count_task(rng: random.Random, colours: tuple[str, ...], size: int = 112) -> dict:
    """Squares of every colour (1-6 each, never touching) on white; how many are one of `colours` (in that order in
    the question, as the program tests them)."""
    picture = Image.new("RGB", (size, size), "white")
    draw, placed, counts = ImageDraw.Draw(picture), [], {}
    for name in COUNT_COLOURS:
        counts[name] = 0
        for _ in range(rng.randint(1, 6)):
            for _ in range(200):
                x, y = rng.randint(1, size - COUNT_SIDE - 1), rng.randint(1, size - COUNT_SIDE - 1)
                if all(abs(x - a) > COUNT_SIDE + 1 or abs(y - b) > COUNT_SIDE + 1 for a, b in placed):
                    placed.append((x, y))
                    draw.rectangle((x, y, x + COUNT_SIDE - 1, y + COUNT_SIDE - 1), fill=COUNT_COLOURS[name])
                    counts[name] += 1
                    break
    named = colours[0] if len(colours) == 1 else ", ".join(colours[:-1]) + " or " + colours[-1]
    return {"image": _png(picture), "question": COUNT_QUESTION.format(colours=named),
            "answer": str(sum(counts[c] for c in colours)), "counts": counts}
