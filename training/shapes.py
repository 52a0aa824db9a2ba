"""A procedurally drawn data set: one coloured shape on a plain background, with a caption
written from the same parameters, and the reverse reading of a picture's attributes.

Everything is a pure function of a torch.Generator, so a seed fixes the whole stream. Bump
GENERATOR_VERSION whenever a change alters a drawn picture or a caption of a given seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

GENERATOR_VERSION = 1

# RGB in [0, 1], kept away from 0 and 1: the embedded decoder's latents hold atanh of the
# picture, which stays near unit scale for these and grows without bound at the extremes.
COLOURS: dict[str, tuple[float, float, float]] = {
    "red": (0.88, 0.12, 0.12),
    "green": (0.12, 0.75, 0.15),
    "blue": (0.12, 0.22, 0.90),
    "yellow": (0.92, 0.88, 0.12),
    "purple": (0.58, 0.15, 0.80),
    "orange": (0.95, 0.55, 0.10),
    "white": (0.94, 0.94, 0.94),
    "black": (0.06, 0.06, 0.06),
}
SHAPES = ("circle", "square", "triangle")
# The radius of a circle of the same area, as a fraction of the picture's side.
SIZES = {"small": 0.13, "large": 0.22}
# Centre (x, y) as fractions of the side; y grows downwards.
POSITIONS: dict[str, tuple[float, float]] = {
    "top left": (0.27, 0.27),
    "top": (0.5, 0.27),
    "top right": (0.73, 0.27),
    "left": (0.27, 0.5),
    "center": (0.5, 0.5),
    "right": (0.73, 0.5),
    "bottom left": (0.27, 0.73),
    "bottom": (0.5, 0.73),
    "bottom right": (0.73, 0.73),
}
POSITION_PHRASES = {
    "top left": "at the top left",
    "top": "at the top",
    "top right": "at the top right",
    "left": "on the left",
    "center": "in the center",
    "right": "on the right",
    "bottom left": "at the bottom left",
    "bottom": "at the bottom",
    "bottom right": "at the bottom right",
}
# How often a caption names each attribute; an attribute left out is still drawn (at random),
# so the model learns what each word means on its own (what a negative prompt relies on).
MENTION = {"colour": 0.9, "shape": 0.85, "size": 0.7, "position": 0.8, "background": 0.8}
JITTER = 0.04  # of the side, for the centre
SIZE_JITTER = 0.12  # relative, for the radius


@dataclass(frozen=True)
class Scene:
    colour: str
    shape: str
    size: str
    position: str
    background: str
    # What was drawn exactly: centre (x, y) and radius, as fractions of the side.
    centre: tuple[float, float]
    radius: float


@dataclass(frozen=True)
class Example:
    scene: Scene
    caption: str


def _pick(options, gen: torch.Generator):
    options = list(options)
    return options[int(torch.randint(len(options), (1,), generator=gen))]


def _chance(p: float, gen: torch.Generator) -> bool:
    return float(torch.rand((), generator=gen)) < p


def random_scene(gen: torch.Generator) -> Scene:
    colour = _pick(COLOURS, gen)
    background = _pick([c for c in COLOURS if c != colour], gen)
    shape, size, position = _pick(SHAPES, gen), _pick(SIZES, gen), _pick(POSITIONS, gen)
    jitter = (torch.rand(3, generator=gen) * 2 - 1).tolist()
    radius = SIZES[size] * (1 + SIZE_JITTER * jitter[2])
    x, y = (c + JITTER * j for c, j in zip(POSITIONS[position], jitter))
    return Scene(colour, shape, size, position, background, (x, y), radius)


def article(words: str) -> str:
    return "an" if words[0] in "aeiou" else "a"


def caption(scene: Scene, mentioned: set[str]) -> str:
    """The caption naming the attributes in `mentioned` (a subset of MENTION's keys)."""
    noun = " ".join(
        [scene.size] * ("size" in mentioned)
        + [scene.colour] * ("colour" in mentioned)
        + [scene.shape if "shape" in mentioned else "shape"]
    )
    words = [article(noun), noun]
    if "position" in mentioned:
        words.append(POSITION_PHRASES[scene.position])
    if "background" in mentioned:
        words.append(f"on {article(scene.background)} {scene.background} background")
    return " ".join(words)


def random_example(gen: torch.Generator) -> Example:
    scene = random_scene(gen)
    mentioned = {name for name, p in MENTION.items() if _chance(p, gen)}
    return Example(scene, caption(scene, mentioned))


def _coverage(scenes: list[Scene], size: int) -> torch.Tensor:
    """The share of each pixel [B, size, size] each scene's shape covers, from the signed
    distance to its outline (a linear ramp one pixel wide: anti-aliased edges)."""
    coords = (torch.arange(size, dtype=torch.float32) + 0.5) / size
    centres = torch.tensor([s.centre for s in scenes])
    r = torch.tensor([s.radius for s in scenes])[:, None, None]
    dx = coords[None, None, :] - centres[:, 0, None, None]
    dy = coords[None, :, None] - centres[:, 1, None, None]
    kind = torch.tensor([SHAPES.index(s.shape) for s in scenes])[:, None, None]
    circle = (dx * dx + dy * dy).sqrt() - r
    square = torch.maximum(dx.abs(), dy.abs()) - r * math.sqrt(math.pi) / 2  # the circle's area
    # An upright triangle of the circle's area (base = height = 2h) whose centroid is the centre.
    h = r * math.sqrt(math.pi / 2)
    triangle = torch.maximum(dy - 2 * h / 3, (dx.abs() - (dy + 4 * h / 3) / 2) / math.sqrt(1.25))
    distance = torch.where(kind == 0, circle, torch.where(kind == 1, square, triangle))
    return (0.5 - distance * size).clamp(0.0, 1.0)


def render(scenes: list[Scene], size: int) -> torch.Tensor:
    """The pictures as uint8 RGB [B, size, size, 3]."""
    alpha = _coverage(scenes, size)[..., None]
    fg = torch.tensor([COLOURS[s.colour] for s in scenes])[:, None, None]
    bg = torch.tensor([COLOURS[s.background] for s in scenes])[:, None, None]
    rgb = bg * (1 - alpha) + fg * alpha
    return (rgb * 255).round().to(torch.uint8)


def batch(gen: torch.Generator, count: int, size: int) -> tuple[torch.Tensor, list[Example]]:
    """`count` examples and their pictures [count, size, size, 3] uint8."""
    examples = [random_example(gen) for _ in range(count)]
    return render([e.scene for e in examples], size), examples


# ---- reading a picture back -------------------------------------------------------------


@dataclass(frozen=True)
class Reading:
    """What a picture shows, as the nearest of the generator's own attributes."""

    colour: str
    background: str
    position: str
    shape: str
    size: str
    area: float  # the shape's share of the picture
    fill: float  # the shape's share of its bounding box: about 1 square, 0.79 circle, 0.5 triangle


# Boundaries between the fills of a square (1), a circle (pi/4) and a triangle (1/2), and between
# the areas of the two sizes.
SQUARE_FILL = 0.9
CIRCLE_FILL = 0.64
LARGE_AREA = math.pi * (SIZES["small"] * SIZES["large"])


def nearest_colour(rgb: torch.Tensor) -> str:
    palette = torch.tensor(list(COLOURS.values()))
    return list(COLOURS)[int(torch.cdist(rgb.float()[None], palette).argmin())]


def _mode_colour(pixels: torch.Tensor) -> str:
    """The palette colour most pixels [N, 3] are nearest to."""
    palette = torch.tensor(list(COLOURS.values()))
    votes = torch.cdist(pixels.float(), palette).argmin(dim=1).bincount(minlength=len(COLOURS))
    return list(COLOURS)[int(votes.argmax())]


def read_picture(image: torch.Tensor) -> Reading:
    """Attributes of a picture [H, W, 3] (uint8, or float in [0, 1]): the background is the
    colour of most border pixels, the shape every pixel nearer another palette colour."""
    rgb = image.float() / 255 if image.dtype == torch.uint8 else image.float()
    h, w, _ = rgb.shape
    border = torch.cat([rgb[0], rgb[-1], rgb[:, 0], rgb[:, -1]])
    background = _mode_colour(border)
    bg = torch.tensor(COLOURS[background])
    mask = (rgb - bg).norm(dim=-1) > 0.3
    if int(mask.sum()) == 0:
        return Reading("none", background, "none", "none", "none", 0.0, 0.0)
    colour = _mode_colour(rgb[mask])
    ys, xs = torch.nonzero(mask, as_tuple=True)
    centre = ((xs.float().mean() + 0.5) / w, (ys.float().mean() + 0.5) / h)
    position = min(POSITIONS, key=lambda p: math.dist(POSITIONS[p], (float(centre[0]), float(centre[1]))))
    box = (int(xs.max() - xs.min()) + 1) * (int(ys.max() - ys.min()) + 1)
    area, fill = float(mask.float().mean()), float(mask.sum()) / box
    shape = "square" if fill > SQUARE_FILL else "circle" if fill > CIRCLE_FILL else "triangle"
    size = "large" if area > LARGE_AREA else "small"
    return Reading(colour, background, position, shape, size, area, fill)
