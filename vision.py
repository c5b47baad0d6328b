"""Images for Qwen2.5-VL-style policies, without a processor object: decoding and the image limits both sides share,
pixel values from the model folder's image processor, kiln's own placeholder expansion, the 3-D (mrope) positions, the
placeholder ids no engine may sample, and the never-scored image sequence that keeps FSDP2's collectives in step.

Trajectories hold one `<|image_pad|>` per image (what the chat template renders and what vLLM expands itself); the
HF engine and the trainer expand each to the image's token count at the model (`expand`), with the same ids and pixel
values as transformers' Qwen2_5_VLProcessor, which cannot be built without torchvision.
"""
import functools
import hashlib
import io
from dataclasses import dataclass

import torch
from PIL import Image
from transformers import AutoConfig, AutoImageProcessor

import task_rows

MIN_SIDE = 28  # a smaller side is scaled up to this (aspect kept), as CodeV's tool does
MAX_ASPECT_RATIO = 100  # a longer/shorter side ratio above this is refused (the image processor raises past 200)
DUMMY_SIDE = 56  # the blank image of an image-less micro-batch: 2x2 merged patches, 4 tokens


def is_vision_model(config) -> bool:
    """Whether the model config is a vision-language one (a vision tower beside the language model)."""
    return getattr(config, "vision_config", None) is not None


def text_attention(config) -> str | None:
    """The language model's attention implementation: a vision-language config keeps it on its text config (the top
    level holds the vision tower's)."""
    return getattr(config.get_text_config(), "_attn_implementation", None)


def banned_token_ids(config) -> list[int]:
    """Ids that are placeholders for image and video features, never text to sample: engines ban them (a sampled
    `<|image_pad|>` would break the feature count at the next forward) and the trainer's logprobs take them out of the
    distribution the same way. None for a text-only model."""
    if not is_vision_model(config):
        return []
    return [i for i in (getattr(config, "image_token_id", None), getattr(config, "video_token_id", None))
            if i is not None]


@functools.cache
def image_processor(path: str):
    """The model folder's image processor (AutoImageProcessor: the torchvision class where torchvision is installed,
    the PIL one where not), loaded once per folder."""
    try:
        return AutoImageProcessor.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: no image processor config (preprocessor_config.json) for a vision model: {e}") from e


def processor_for(config):
    """image_processor of the folder `config` was loaded from."""
    return image_processor(str(config._name_or_path))


def load_image(image) -> Image.Image:
    """An RGB PIL image from encoded bytes (PNG, JPEG, ...) or a PIL image, within the limits both the rollout and the
    model apply: transparency flattened onto white (as transformers' image processors do), a side under MIN_SIDE
    scaled up (aspect kept), an aspect ratio over MAX_ASPECT_RATIO refused."""
    if not isinstance(image, Image.Image):
        image = Image.open(io.BytesIO(image))
    width, height = image.size
    if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
        raise ValueError(f"image of {width}x{height} pixels: aspect ratio over {MAX_ASPECT_RATIO}")
    if image.mode != "RGB":
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        image = Image.alpha_composite(white, image.convert("RGBA")).convert("RGB")
    if min(width, height) < MIN_SIDE:
        scale = MIN_SIDE / min(width, height)
        image = image.resize((max(MIN_SIDE, round(width * scale)), max(MIN_SIDE, round(height * scale))),
                             Image.Resampling.BICUBIC)
    return image


def image_tokens(processor, image) -> int:
    """How many placeholder tokens `image` (any form load_image takes) expands to at the model: its merged patches
    after the processor's resize into [min_pixels, max_pixels]."""
    width, height = load_image(image).size
    return processor.get_number_of_image_patches(height, width, {}) // processor.merge_size ** 2


@dataclass(frozen=True)
class ImageCounter:
    """image_tokens by one image processor, called as `count_image(image)`; `key`, the processor's settings, names
    the counts so they can be cached (rollout.prompt_lengths)."""

    processor: object

    def __call__(self, image) -> int:
        return image_tokens(self.processor, image)

    @property
    def key(self) -> str:
        return self.processor.to_json_string()


@functools.lru_cache(maxsize=8)  # asked at every rollout phase: the config and image processor load once
def image_counter(path: str) -> ImageCounter | None:
    """image_tokens by the image processor of the model folder at `path` (its own min/max pixels), for a
    vision-language model; None for a text model."""
    if not is_vision_model(AutoConfig.from_pretrained(path, local_files_only=True)):
        return None
    return ImageCounter(image_processor(str(path)))


def images_per_prompt(model: str, row_sets: list, tool_images: int) -> int | None:
    """The image budget vLLM reserves per prompt for a vision-language model: the most images a row of `row_sets`
    (lists or task_rows.Rows) has, plus `tool_images`, what a trajectory's tool calls may add; None for a text
    model."""
    if not is_vision_model(AutoConfig.from_pretrained(model, local_files_only=True)):
        return None
    return max(len(images or []) for rows in row_sets for images in task_rows.values(rows, "images")) + tool_images


def added_tokens(config, prompt_ids: list[int], images: list) -> tuple[int, int]:
    """The tokens a sample's image placeholders add when expanded (its `images`, the prompt's first): in all, and
    within its prompt. What a length budget counts beyond the ids."""
    processor = processor_for(config)
    added = [image_tokens(processor, image) - 1 for image in images]
    return sum(added), sum(added[: prompt_ids.count(config.image_token_id)])


def digest(image) -> str:
    """A content hash of an image (its encoded bytes, or a PIL image's pixels): vLLM's multi_modal_uuids, and the key
    that tells a shared prompt's images from another prompt's."""
    if isinstance(image, Image.Image):
        return hashlib.sha256(f"{image.mode}{image.size}".encode() + image.tobytes()).hexdigest()
    return hashlib.sha256(bytes(image)).hexdigest()


@functools.lru_cache(maxsize=512)  # the old, reference and updated policies all see the same images in a step
def _pixels_of(processor, keyed: "_Keyed") -> tuple[torch.Tensor, torch.Tensor]:
    out = processor(images=[load_image(keyed.image)], return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


class _Keyed:
    """An image with its digest: hashed by the digest, so lru_cache never hashes the pixels twice."""

    def __init__(self, image):
        self.image, self.key = image, digest(image)

    def __hash__(self):
        return hash(self.key)

    def __eq__(self, other):
        return self.key == other.key


def pixels(processor, images: list) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel_values [patches, 3*2*14*14], image_grid_thw [images, 3]) of `images` in order, as the processor gives
    them for the list (each image is resized on its own)."""
    if not images:
        raise ValueError("pixels() needs at least one image")
    parts = [_pixels_of(processor, _Keyed(image)) for image in images]
    return torch.cat([p for p, _ in parts]), torch.cat([g for _, g in parts])


def expand(ids: list[int], grids: torch.Tensor, pad_id: int, merge_size: int) -> tuple[list[int], list[int]]:
    """The ids with the i-th image placeholder repeated grid_t*grid_h*grid_w / merge_size**2 times (image i's
    features), and where each original token lands in the expanded ids."""
    expanded, where, image = [], [], 0
    for token in ids:
        where.append(len(expanded))
        if token == pad_id:
            if image == len(grids):
                raise ValueError(f"{sum(t == pad_id for t in ids)} image placeholders but {len(grids)} images")
            expanded += [pad_id] * (int(grids[image].prod()) // merge_size ** 2)
            image += 1
        else:
            expanded.append(token)
    if image != len(grids):
        raise ValueError(f"{image} image placeholders but {len(grids)} images")
    return expanded, where


def rope_positions(model, expanded: list[int], grids: torch.Tensor | None) -> torch.Tensor:
    """[3, L] mrope positions (temporal, height, width) of one expanded sequence, the model's own get_rope_index."""
    ids = torch.tensor([expanded])
    if grids is None or not len(grids):
        return torch.arange(len(expanded)).expand(3, -1)
    positions, _ = model.model.get_rope_index(ids, mm_token_type_ids=(ids == model.config.image_token_id).int(),
                                              image_grid_thw=grids)
    return positions[:, 0]


def dummy_sequence(config) -> tuple[list[int], Image.Image]:
    """A never-scored sequence with one blank image, packed into a micro-batch that has none: under FSDP2 every rank
    must run the vision tower's units in every forward, in the same order, or the collectives mismatch (gloo aborts,
    NCCL hangs)."""
    ids = [config.vision_start_token_id, config.image_token_id, config.vision_end_token_id]
    return ids, Image.new("RGB", (DUMMY_SIDE, DUMMY_SIDE))


@dataclass
class ExpandedBatch:
    """The sequences of one packed forward with every placeholder expanded to its image's tokens."""

    sequences: list[list[int]]  # expanded; a blank-image sequence last when none of the given had an image
    score_from: list[int]  # each sequence's first scored token, in expanded positions
    prefix_keys: list[tuple]  # digests of each sequence's images before score_from: a shared prompt shares them
    images: list[list]  # each sequence's images, in the order of their placeholders
    starts: list[list[int]]  # where each image's tokens start in its expanded sequence
    grids: list[torch.Tensor]  # each sequence's image_grid_thw
    where: list[list[int]]  # each given token's index in its expanded sequence (the given sequences only)

    def given_index(self) -> torch.Tensor:
        """For each token of the concatenated expanded sequences, its index in the concatenated given ones (-1 for
        the tokens an expansion added and for the blank sequence)."""
        index = torch.full((sum(map(len, self.sequences)),), -1, dtype=torch.long)
        expanded_at, given_at = 0, 0
        for sequence, where in zip(self.sequences, self.where):
            index[expanded_at + torch.tensor(where, dtype=torch.long)] = given_at + torch.arange(len(where))
            expanded_at, given_at = expanded_at + len(sequence), given_at + len(where)
        return index


def expand_batch(config, sequences: list[list[int]], images: list[list] | None,
                 score_from: list[int]) -> ExpandedBatch:
    """The sequences (one `<|image_pad|>` per image) expanded with their images (`images[i]`: sequence i's, PNG bytes
    or PIL), plus a never-scored blank-image sequence when none has an image (`dummy_sequence`)."""
    images = [list(i) for i in images] if images is not None else [[] for _ in sequences]
    given = len(sequences)
    if len(images) != len(sequences):
        raise ValueError(f"{len(images)} image lists for {len(sequences)} sequences")
    if not any(images):
        dummy, blank = dummy_sequence(config)
        sequences, score_from, images = [*sequences, dummy], [*score_from, len(dummy)], [*images, [blank]]
    processor, pad = processor_for(config), config.image_token_id
    grids = [pixels(processor, i)[1] if i else torch.zeros(0, 3, dtype=torch.long) for i in images]
    expanded = [expand(s, g, pad, processor.merge_size) for s, g in zip(sequences, grids)]
    starts = [[w[j] for j, t in enumerate(s) if t == pad] for s, (_, w) in zip(sequences, expanded)]
    score_from = [(w + [len(e)])[f] for (e, w), f in zip(expanded, score_from)]
    prefix_keys = [tuple(digest(image) for image, at in zip(i, st) if at < f)
                   for i, st, f in zip(images, starts, score_from)]
    return ExpandedBatch([e for e, _ in expanded], score_from, prefix_keys, images, starts, grids,
                         [w for _, w in expanded[:given]])


def row_inputs(model, batch: ExpandedBatch, pieces: list[tuple[int, int]], device) -> tuple[torch.Tensor, dict]:
    """For a packed row laid out as `pieces` ((sequence, first token) each): mrope's [3, L] positions (a piece takes
    its part of its whole sequence's) and the vision inputs, pixel_values and image_grid_thw of the images whose
    tokens the row holds, in row order (a branch never repeats the images of the prompt it shares)."""
    rope = {i: rope_positions(model, batch.sequences[i], batch.grids[i]) for i in {i for i, _ in pieces}}
    mrope = torch.cat([rope[i][:, begin:] for i, begin in pieces], 1)
    in_row = [image for i, begin in pieces for image, at in zip(batch.images[i], batch.starts[i]) if at >= begin]
    pixel_values, grid = pixels(processor_for(model.config), in_row)
    return mrope, {"pixel_values": pixel_values.to(device), "image_grid_thw": grid.to(device)}
