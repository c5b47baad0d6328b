"""CodeV's data and protocol: the codev importer and extract-images on parquets in CodeV / DeepEyes shape, vision_toy
(deterministic, answers recomputed from the images), the <code> tag protocol token-in-token-out with a scripted engine
(check_tito, SFT's encode_conversation, masks), images in budgets and samples, the Python tool's images and paths."""
import dataclasses
import functools
import io
import sys
from collections import deque
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import chat  # noqa: E402
import data_prep  # noqa: E402
import engines  # noqa: E402
import policy  # noqa: E402
import rewards  # noqa: E402
import rollout  # noqa: E402
import task_rows  # noqa: E402
import tiny  # noqa: E402
import tools  # noqa: E402
import vision  # noqa: E402
import vision_tasks  # noqa: E402

CORPUS = ["<code>```python\nprint(image.size)\n```</code>\n\n", "<answer>3</answer>", "Let me crop the image.",
          "<sandbox_output>(56, 56)\n</sandbox_output>", "I think the output is 7."] * 20


def png(size: tuple[int, int], colour="red", mode="RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, colour).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return policy.load_tokenizer(tiny.make_tiny_model(tmp_path_factory.mktemp("tiny"), CORPUS))


# ------------------------------------------------------------------------------------------------------------- data


def codev_parquet(path: Path) -> list[dict]:
    """Two rows as CodeV / DeepEyes store them: <image> markers, images as {bytes, path} (one only as a path)."""
    (path.parent / "pic.png").write_bytes(png((40, 30), "blue"))
    records = [
        {"data_source": "vstar", "ability": "vqa", "env_name": "code",
         "prompt": [{"role": "system", "content": "Use code."},
                    {"role": "user", "content": "<image>\nWhat colour is the car?"}],
         "images": [{"bytes": png((32, 32)), "path": None}],
         "reward_model": {"ground_truth": "red", "style": "model"},
         "extra_info": {"answer": "red", "question": "What colour is the car?", "index": 5, "split": "train"}},
        {"data_source": "chart", "ability": "vqa", "env_name": "code",
         "prompt": [{"role": "user", "content": "Compare <image> and <image> please"}],
         "images": [{"bytes": None, "path": "pic.png"}, {"bytes": png((8, 8), "green"), "path": "x.png"}],
         "reward_model": {"ground_truth": "2", "style": "rule"},
         "extra_info": {"answer": "2", "question": "Compare", "index": 6, "split": "test"}},
    ]
    pq.write_table(pa.Table.from_pylist(records), path)
    return records


def test_codev_import_round_trip(tmp_path):
    source = tmp_path / "codev.parquet"
    records = codev_parquet(source)
    data_prep.codev(source, tmp_path / "rows.parquet")
    rows = task_rows.load_rows(tmp_path / "rows.parquet")
    assert rows == data_prep.codev_rows(source)
    first, second = rows
    assert first["prompt"][1]["content"] == [{"type": "image"}, {"type": "text", "text": "\nWhat colour is the car?"}]
    assert first["prompt"][0]["content"] == "Use code."
    assert first["images"] == [records[0]["images"][0]["bytes"]]
    assert first["reward_model"] == {"style": "judge", "ground_truth": "red"}  # "model": math-verify, else judge
    assert first["extra_info"]["env_name"] == "code" and first["extra_info"]["question"] == "What colour is the car?"
    assert [p["type"] for p in second["prompt"][0]["content"]] == ["text", "image", "text", "image", "text"]
    assert second["images"] == [png((40, 30), "blue"), records[1]["images"][1]["bytes"]]
    assert second["reward_model"]["style"] == "rule" and task_rows.row_id(second) == "chart/6"


def test_image_parts_and_images_must_agree(tmp_path):
    source = tmp_path / "codev.parquet"
    codev_parquet(source)
    raw = pq.read_table(source).to_pylist()  # loaded as if it were kiln rows: the markers are not image parts
    with pytest.raises(task_rows.RowError, match=r"row 0: images: 1 images but the prompt has 0 image parts \(its "
                       r"text holds <image> markers: convert the file with `python data_prep.py codev`\)"):
        task_rows.write_rows(raw, tmp_path / "raw.parquet")
    rows = data_prep.codev_rows(source)
    rows[1]["images"] = rows[1]["images"][:1]
    with pytest.raises(task_rows.RowError, match=r"rows.parquet row 1: images: 1 images but the prompt has 2 image"):
        task_rows.write_rows(rows, tmp_path / "rows.parquet")


def test_extract_images_writes_rgb_files_and_their_paths(tmp_path):
    source = tmp_path / "codev.parquet"
    records = codev_parquet(source)
    records[0]["images"] = [{"bytes": png((4, 4), (255, 0, 0, 0), "RGBA"), "path": None}]  # fully transparent red
    records[0]["extra_info"]["image_file_name"] = "car.png"
    pq.write_table(pa.Table.from_pylist(records), source)
    data_prep.extract_images(source, tmp_path / "images")
    out = pq.read_table(tmp_path / "codev_with_image_paths.parquet").to_pylist()
    first, second = (r["extra_info"] for r in out)
    assert first["image_file_path"] == str((tmp_path / "images" / "car.png").resolve())
    car = Image.open(first["image_file_path"])
    assert car.mode == "RGB" and car.getpixel((0, 0)) == (255, 255, 255)  # alpha flattened onto white
    assert [Path(p).name for p in second["image_file_paths"]] == ["6_0.png", "6_1.png"]
    assert Image.open(second["image_file_paths"][0]).getpixel((0, 0)) == (0, 0, 255)
    assert out[1]["prompt"] == records[1]["prompt"]  # the rest of the row as it was


def connected_components(mask: np.ndarray) -> int:
    seen, count = np.zeros_like(mask), 0
    for y, x in zip(*np.nonzero(mask)):
        if seen[y, x]:
            continue
        count += 1
        queue = deque([(y, x)])
        seen[y, x] = True
        while queue:
            a, b = queue.popleft()
            for c, d in ((a + 1, b), (a - 1, b), (a, b + 1), (a, b - 1)):
                if 0 <= c < mask.shape[0] and 0 <= d < mask.shape[1] and mask[c, d] and not seen[c, d]:
                    seen[c, d] = True
                    queue.append((c, d))
    return count


def test_vision_toy_is_deterministic_and_its_answers_are_right():
    train, test = data_prep.vision_toy_rows(6, 3, seed=3, size=256)
    assert (train, test) == data_prep.vision_toy_rows(6, 3, seed=3, size=256)
    assert train != data_prep.vision_toy_rows(6, 3, seed=4, size=256)[0]
    rows = train + test
    assert [r["extra_info"]["difficulty"] for r in rows] == ["dots", "text", "chart"] * 3
    assert [r["extra_info"]["split"] for r in rows] == ["train"] * 6 + ["test"] * 3
    closes = {f"{close:.2f}" for _, close in vision_tasks._msft_closes()}
    dates = {date for date, _ in vision_tasks._msft_closes()}
    for row in rows:
        task_rows.validate_row(row)
        answer, box = row["reward_model"]["ground_truth"], row["extra_info"]["target_box"]
        picture = Image.open(io.BytesIO(row["images"][0])).convert("RGB")
        family = row["extra_info"]["difficulty"]
        if family == "dots":  # recount the asked colour's dots, and they all lie in the target box
            colour = row["prompt"][1]["content"][1]["text"].split()[2]
            mask = (np.asarray(picture) == vision_tasks.DOT_COLOURS[colour]).all(-1)
            assert connected_components(mask) == int(answer)
            ys, xs = np.nonzero(mask)
            assert box[0] <= xs.min() and xs.max() < box[2] and box[1] <= ys.min() and ys.max() < box[3]
        elif family == "text":  # the box holds exactly the answer drawn in the task's font
            font = ImageFont.load_default(size=10)
            left, top, right, bottom = ImageDraw.Draw(picture).textbbox((0, 0), answer, font=font)
            drawn = Image.new("RGB", (right - left, bottom - top), "white")
            ImageDraw.Draw(drawn).text((-left, -top), answer, fill="black", font=font)
            assert np.array_equal(np.asarray(picture.crop(box)), np.asarray(drawn))
        else:
            assert answer in (closes if row["prompt"][1]["content"][1]["text"].startswith("What") else dates)
        # The rule reward: the right answer with a returned crop of the target box scores everything.
        crop = io.BytesIO()
        picture.crop(box).save(crop, format="PNG")
        reward = rewards.vl_agent_reward(row, f"<answer>{answer}</answer>",
                                         rewards.ScoreContext(sample_info={"images": [crop.getvalue()]}))
        assert (reward.info["acc"], reward.info["format"], reward.info["tool"]) == (1.0, 1.0, 1.0)


def test_rule_tool_reward_reads_row_images_as_data_prep_does(tmp_path):
    """The tool reward's input image, stored as a {"bytes", "path"} dict with only its path (as Hugging Face's Image
    feature leaves it), is read by data_prep's loader: a crop of its target box scores 1, a crop elsewhere 0."""
    picture = Image.new("RGB", (64, 64), "white")
    picture.paste((255, 0, 0), (10, 10, 20, 20))
    picture.save(tmp_path / "source.png")
    row = codev_row(images=[{"bytes": None, "path": str(tmp_path / "source.png")}],
                    extra_info={"index": 0, "split": "train", "target_box": [10, 10, 20, 20]})

    def crop(box) -> bytes:
        buf = io.BytesIO()
        picture.crop(box).save(buf, format="PNG")
        return buf.getvalue()

    assert rewards.vl_tool_score(row, "", None, {"images": [crop((5, 5, 30, 30))]}).value == 1.0
    assert rewards.vl_tool_score(row, "", None, {"images": [crop((30, 30, 60, 60))]}).value == 0.0


# ----------------------------------------------------------------------------------------------- the tag protocol


class TagEngine:
    """Replies in order, one per call (one trajectory): the reply's canonical ids, then what a model might go on with
    after </code> (a made-up output), then the end-of-turn token; records the images it was given."""

    def __init__(self, tokenizer, replies: list[str], run_on: str = "\nI think the output is 7."):
        self.tokenizer, self.replies, self.run_on = tokenizer, list(replies), run_on
        self.eot = tokenizer.convert_tokens_to_ids(chat.end_of_turn(tokenizer))
        self.calls, self.emitted, self.images = 0, [], []

    def generate(self, prompts, sampling, images=None):
        self.calls += 1
        self.images.append(images)
        reply = self.replies.pop(0)
        ids = self.tokenizer(reply + (self.run_on if reply.endswith("</code>") else ""),
                             add_special_tokens=False)["input_ids"] + [self.eot]
        kept = chat.code_stop(self.tokenizer, ids) or len(ids)
        self.emitted += ids[:kept]
        return [engines.Completion(ids, [-(self.calls + k / 1000) for k in range(len(ids))], "stop")]

    def load_weights(self, weights):
        return None


def replay_codev_toolbox(outputs: list[tools.ToolResult]):
    def new_toolbox(row):
        queue = list(outputs)
        return tools.ToolBox({"python": lambda arguments: queue.pop(0)}, [], protocol="codev")
    return new_toolbox


ROW_IMAGE, TOOL_IMAGE = png((56, 56)), png((28, 56), "blue")
ACTION = "Let me crop the image.\n<code>```python\nimage.crop((0, 0, 28, 56)).show()\n```</code>"


def codev_row(**overrides) -> dict:
    row = {"data_source": "vision_toy", "ability": "vision", "images": [ROW_IMAGE],
           "prompt": [{"role": "system", "content": data_prep.CODEV_SYSTEM},
                      {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many dots?"}]}],
           "reward_model": {"style": "rule", "ground_truth": "3"},
           "extra_info": {"index": 0, "split": "train", "target_box": [0, 0, 4, 4]}}
    return row | overrides


def test_tag_protocol_token_in_token_out(tokenizer):
    engine = TagEngine(tokenizer, [ACTION, "<answer>3</answer>"])
    output = tools.ToolResult("shown 1 image <|im_end|>", images=[TOOL_IMAGE])  # a tool printing a template token
    samples, metrics = rollout.multi_turn(engine, tokenizer, [codev_row()], 1, engines.Sampling(max_new_tokens=200),
                                          replay_codev_toolbox([output]), rollout.AgentLimits(max_turns=4))
    sample = samples[0]
    messages = sample.info["messages"]
    assert sample.finish_reason == "stop" and metrics["tools/calls_mean"] == 1
    assert messages[2:] == [
        {"role": "assistant", "content": ACTION + "\n"},  # </code> ends inside the token ">\n": that id is kept
        {"role": "user", "content": [{"type": "text", "text": "<sandbox_output>shown 1 image <|im_end|>\n"},
                                     {"type": "image"}, {"type": "text", "text": "</sandbox_output>"}]},
        {"role": "assistant", "content": "<answer>3</answer>"}]
    assert chat.check_tito(tokenizer, sample, messages) == {}
    ids, mask = chat.encode_conversation(tokenizer, messages)  # what SFT trains on: the same ids and mask
    n = len(sample.ids)
    assert ids[:n] == sample.ids and mask[:n] == [0] * len(sample.prompt_ids) + sample.loss_mask
    # Mask 1 exactly on the sampled ids (the made-up output after </code> is gone), logprobs only there.
    assert [i for i, m in zip(sample.completion_ids, sample.loss_mask) if m] == engine.emitted
    assert all((lp != 0) == bool(m) for lp, m in zip(sample.engine_logprobs, sample.loss_mask))
    assert "I think the output is 7" not in tokenizer.decode(sample.completion_ids)
    # 0 on the end-of-turn after </code> (not sampled), the observation and its image tokens; 1 on the last one.
    eot = engine.eot
    eots = [k for k, t in enumerate(sample.completion_ids) if t == eot]
    assert [sample.loss_mask[k] for k in eots] == [0, 0, 1]  # after </code>, closing the observation, the answer's
    vision = {tokenizer.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")}
    assert all(not m for t, m in zip(sample.completion_ids, sample.loss_mask) if t in vision)
    observation = tokenizer.decode([t for t, m in zip(sample.completion_ids, sample.loss_mask) if not m])
    assert observation.count("<|im_end|>") == 3  # two written by the template, one printed by the tool as text
    # The row's image reached the engine at the first turn, the tool's joined it at the second.
    assert engine.images == [[[ROW_IMAGE]], [[ROW_IMAGE, TOOL_IMAGE]]]
    assert sample.images == [ROW_IMAGE, TOOL_IMAGE] and sample.info["images"] == [TOOL_IMAGE]
    assert sample.ids.count(chat.image_pad_id(tokenizer)) == 2


def test_code_stop_inside_a_token_keeps_the_ids(tokenizer):
    ids = tokenizer("<code>```python\nprint(1)\n```</code>\n\nmore", add_special_tokens=False)["input_ids"]
    kept = chat.code_stop(tokenizer, ids)
    assert "</code>" in tokenizer.decode(ids[:kept]) and "</code>" not in tokenizer.decode(ids[:kept - 1])
    last = tokenizer.decode(ids[kept - 1 : kept])
    assert last.endswith(">\n\n") and last != ">"  # the stop string ends inside this token: text cut, id kept
    text = tokenizer.decode(ids[:kept])
    assert chat.parse_code_action(text) == [{"name": "python", "arguments": {"code": "print(1)"}}]
    assert chat.code_stop(tokenizer, tokenizer("no code", add_special_tokens=False)["input_ids"]) is None
    assert chat.parse_code_action("<answer>3</answer><code>print(1)</code>") == []  # an answer ends the episode
    assert chat.parse_code_action("print(1)</code>")[0].startswith("Error: </code> without an opening <code>")


QWEN2_5_VL_PROCESSOR = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=12_845_056, patch_size=14,
                                                temporal_patch_size=2, merge_size=2)  # Qwen2.5-VL-7B's preprocessor
count_qwen_tokens = functools.partial(vision.image_tokens, QWEN2_5_VL_PROCESSOR)


def test_image_tokens_follow_qwen2_5_vl_resizing():
    assert count_qwen_tokens(png((56, 56))) == 4
    assert count_qwen_tokens(png((10, 10))) == 4  # scaled up to 28 x 28 (vision.MIN_SIDE), then to min_pixels
    assert count_qwen_tokens(png((1024, 768))) == (1036 // 28) * (756 // 28)  # sides rounded to 28-pixel blocks
    small = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=28 * 28 * 64, patch_size=14, merge_size=2)
    assert vision.image_tokens(small, png((1024, 768))) <= 64
    assert rollout.placeholder_only(png((1024, 768))) == 1  # a text-only model sees the placeholder alone


def test_an_observation_that_does_not_fit_ends_the_trajectory_without_its_images(tokenizer):
    big = png((560, 560), "blue")  # 400 tokens once expanded
    prompt = len(chat.encode_prompt(tokenizer, codev_row()["prompt"])) + 3  # the row's image: 4 tokens, not 1
    engine = TagEngine(tokenizer, [ACTION])
    limits = rollout.AgentLimits(max_turns=4, max_total_tokens=prompt + 300)
    samples, metrics = rollout.multi_turn(engine, tokenizer, [codev_row()], 1, engines.Sampling(max_new_tokens=100),
                                          replay_codev_toolbox([tools.ToolResult("big", images=[big])]), limits,
                                          count_image=count_qwen_tokens)
    sample = samples[0]
    assert sample.finish_reason == "max_total_tokens" and metrics["rollout/finish_max_total_tokens_frac"] == 1
    assert sample.images == [ROW_IMAGE] and sample.info["images"] == []
    assert sample.ids.count(chat.image_pad_id(tokenizer)) == 1 and all(sample.loss_mask)  # ends on the policy's turn
    assert chat.check_tito(tokenizer, sample, sample.info["messages"]) == {}  # ends right after </code>
    # The same observation fits a bigger budget: the images come with it.
    engine = TagEngine(tokenizer, [ACTION, "<answer>3</answer>"])
    limits = rollout.AgentLimits(max_turns=4, max_total_tokens=prompt + 600)
    samples, _ = rollout.multi_turn(engine, tokenizer, [codev_row()], 1, engines.Sampling(max_new_tokens=100),
                                    replay_codev_toolbox([tools.ToolResult("big", images=[big])]), limits,
                                    count_image=count_qwen_tokens)
    assert samples[0].images == [ROW_IMAGE, big] and samples[0].ids.count(chat.image_pad_id(tokenizer)) == 2


def test_a_sample_whose_images_and_placeholders_differ_is_refused(tokenizer):
    engine = TagEngine(tokenizer, ["<answer>3</answer>"])
    with pytest.raises(RuntimeError, match="vision_toy/0: the trajectory has 2 images but 1 image placeholders"):
        rollout.multi_turn(engine, tokenizer, [codev_row(images=[ROW_IMAGE, ROW_IMAGE])], 1,
                           engines.Sampling(max_new_tokens=50), replay_codev_toolbox([]))


PARROT_ROW = codev_row(prompt=[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}]}])


@pytest.fixture(scope="module")
def parrot(tmp_path_factory):
    """The tiny model trained until greedy decoding says ACTION, then runs on past </code> (the made-up output a
    model writes when nothing stops it) and ends its turn: (model, tokenizer, prompt ids, the ids it says)."""
    folder = tiny.make_tiny_model(tmp_path_factory.mktemp("parrot"), CORPUS)
    tokenizer, model = policy.load_tokenizer(folder), policy.load_model(folder)
    prompt = chat.encode_prompt(tokenizer, PARROT_ROW["prompt"])
    said = tokenizer(ACTION + "\nI think the output is 7.", add_special_tokens=False)["input_ids"] + [
        tokenizer.convert_tokens_to_ids("<|im_end|>")]
    ids = torch.tensor([prompt + said])
    torch.manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(150):
        logprobs = model(ids).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
        chosen = logprobs.gather(1, ids[0, len(prompt):, None])
        if chosen.min().exp() > 0.9:  # every token a clear greedy choice
            break
        optimizer.zero_grad()
        (-chosen.mean()).backward()
        optimizer.step()
    return model.eval(), tokenizer, prompt, said


def test_hf_engine_stops_where_a_stop_string_ends_inside_a_token(parrot):
    model, tokenizer, prompt, said = parrot
    greedy = engines.Sampling(max_new_tokens=len(said) + 5, temperature=0)
    free = engines.HFEngine(model, tokenizer.pad_token_id).generate([prompt], greedy)[0]
    assert free.token_ids[: len(said)] == said  # unstopped, it says everything
    engine = engines.HFEngine(model, tokenizer.pad_token_id)  # the tokenizer comes from the model's folder
    stopped = engine.generate([prompt, prompt], dataclasses.replace(greedy, stop=["</code>", "never written"]))
    kept = next(k for k, token in enumerate(said) if tokenizer.decode([token]) == ">\n") + 1
    for completion in stopped:  # the ids as sampled, up to the token that completes </code>, that token whole
        assert completion.token_ids == said[:kept] and completion.finish_reason == "stop"
        assert completion.logprobs == pytest.approx(free.logprobs[:kept], abs=1e-5)
    assert tokenizer.decode(stopped[0].token_ids).endswith("</code>\n")  # the text runs on past the stop string
    assert chat.code_stop(tokenizer, said) == kept
    # A stop string that ends where a token ends; one never written: the budget ends the completion.
    at_boundary = engine.generate([prompt], dataclasses.replace(greedy, stop=["crop(("]))[0]
    assert tokenizer.decode(at_boundary.token_ids).endswith("image.crop((") and at_boundary.finish_reason == "stop"
    unwritten = engine.generate([prompt], dataclasses.replace(greedy, max_new_tokens=8, stop=["</table>"]))[0]
    assert unwritten.token_ids == said[:8] and unwritten.finish_reason == "length"


def test_codev_turns_end_at_code_stop_with_nothing_generated_after_it(parrot):
    """A codev rollout with the real HFEngine: the engine is asked to stop on </code> and returns no token after
    the one that completes it (before, it generated on and the rollout threw that away)."""
    model, tokenizer, _, said = parrot

    class Recording(engines.HFEngine):  # through its continuous batch, as the rollout drives it
        def submit(self, key, prompt, sampling, seed=None):
            self.asked.append(sampling)
            super().submit(key, prompt, sampling, seed)

        def step(self):
            finished = super().step()
            self.returned += [completion for _, completion in finished]
            return finished

    engine = Recording(model, tokenizer.pad_token_id, tokenizer=tokenizer)
    engine.asked, engine.returned = [], []
    assert engines.continuous(engine)
    sampling = engines.Sampling(max_new_tokens=len(said) + 5, temperature=0,
                                stop_token_ids=[tokenizer.convert_tokens_to_ids("<|im_end|>")])
    samples, _ = rollout.multi_turn(engine, tokenizer, [PARROT_ROW], 1, sampling,
                                    replay_codev_toolbox([tools.ToolResult("(28, 56)")]),
                                    rollout.AgentLimits(max_turns=2))
    sample, first_sampling, first = samples[0], engine.asked[0], engine.returned[0]
    kept = chat.code_stop(tokenizer, said)
    assert first_sampling.stop == ["</code>"] and sampling.stop == []
    assert first.token_ids == said[:kept] and first.finish_reason == "stop"
    assert sample.completion_ids[:kept] == said[:kept] and sample.loss_mask[:kept] == [1] * kept
    assert sample.loss_mask[kept] == 0  # the end-of-turn token after </code> is the rollout's, then the observation
    assert sample.info["messages"][1] == {"role": "assistant", "content": ACTION + "\n"}
    assert sample.info["tool_calls"] == 1
    assert chat.check_tito(tokenizer, sample, sample.info["messages"]) == {}


# ----------------------------------------------------------------------------------------------- the python tool


def test_fit_images_applies_codev_limits():
    wide, tiny_image, square = png((3000, 20)), png((10, 40)), png((64, 64))
    kept, notes = tools.fit_images([wide, tiny_image] + [square] * 6, tools.ImageLimits(max_pixels=60 * 60))
    sizes = [Image.open(io.BytesIO(k)).size for k in kept]
    assert sizes == [(28, 112)] + [(60, 60)] * 4  # upscaled short side; downscaled to max_pixels; five kept
    assert notes == ["image 1 dropped: its aspect ratio 3000x20 is over 100", "only the first 5 of 7 images are kept"]
    assert tools.fit_images([b"not a png"])[1] == ["image 1 dropped: not a readable image (UnidentifiedImageError)"]


def test_python_tool_gets_the_row_images_and_rewrites_mnt_data(tokenizer):
    row = codev_row(images=[png((30, 20)), png((50, 40), "green")],
                    prompt=[{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}])
    box = tools.TOOLBOXES["codev"](row)
    try:
        assert box.schemas == [] and box.protocol == "codev"
        out = box.tools["python"]({"code": "import os\nprint(sorted(os.listdir('/mnt/data')), image.size, [i.size "
                                           "for i in images])\nimage.crop((0, 0, 10, 10)).save('/mnt/data/c.png')"})
        assert out.text.split("\n")[0] == ("['input_image.png', 'input_image_0.png', 'input_image_1.png'] (30, 20) "
                                           "[(30, 20), (50, 40)]")
        assert not out.error and [Image.open(io.BytesIO(i)).size for i in out.images] == [(28, 28)]  # 10 -> 28 px
    finally:
        box.close()
    engine = TagEngine(tokenizer, ["<code>```python\nprint(image.size)\n```</code>", "<answer>3</answer>"])
    samples, _ = rollout.collect(engine, tokenizer, [codev_row()], 1, engines.Sampling(max_new_tokens=100),
                                 tools="codev", check=True)
    assert samples[0].info["messages"][3]["content"][0]["text"] == "<sandbox_output>(56, 56)\n"
    assert chat.check_tito(tokenizer, samples[0], samples[0].info["messages"]) == {}
