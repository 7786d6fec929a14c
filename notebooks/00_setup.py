# %% [markdown]
# # 00 · Setup and conventions
#
# **What you will build:** nothing big yet, just the few helpers every later notebook starts
# with: picking a device, checking inputs, seeding, adding a method to a class one cell at a
# time, and saving a figure. On the way you will see how the course fits together: notebooks, the
# `transformer_from_scratch` package they write, the tests, and the commands that check them all.
#
# [Open in Colab](https://colab.research.google.com/github/transformer-from-scratch/transformer-from-scratch/blob/main/notebooks/00_setup.ipynb) · Assumes: Python and a little PyTorch (tensors, `nn.Module`, autograd).

# %%
# Setup. On Colab, install the course's package (Colab's own torch is kept as it is).
import sys

if "google.colab" in sys.modules:
    import subprocess

    PACKAGE = "transformer-from-scratch @ git+https://github.com/transformer-from-scratch/transformer-from-scratch@main"
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", PACKAGE], capture_output=True, text=True
    )
    if pip.returncode != 0:
        raise RuntimeError(
            f"Could not install the course's package {PACKAGE!r}. pip said:\n"
            f"{pip.stderr.strip()[-800:]}\n"
            "Opened from a fork? Point the notebooks at it with `make fork REPO=owner/name`, "
            "push, and open the notebook from the fork (README, 'Forks')."
        )

# %% [markdown]
# ## How the course is put together
#
# Every notebook is a pair of files with the same cells: `NN_topic.py`, a plain Python script in
# jupytext's *percent* format that is easy to review in a diff, and `NN_topic.ipynb`, the same
# cells plus their outputs. Open either one in JupyterLab; saving one rewrites the other.
#
# Code that later notebooks need is written **once**, in a cell whose first line is `#| export`.
# `make export` copies those cells into the package `src/transformer_from_scratch/`, so notebook
# 03 can say `from transformer_from_scratch.attention import scaled_dot_product_attention`
# instead of pasting notebook 02 again. A cell without the marker is teaching code: a first
# version that a later cell replaces, a plot, a check.
#
# The package has its own tests in `tests/`, one file per topic (`tests/test_utils.py` for this
# notebook's helpers, `tests/test_checks.py` for its input checks): shapes, agreement with
# PyTorch's built-ins, the error a bad input gets. Run one file with
# `.venv/bin/python -m pytest -q tests/test_utils.py`.
#
# | you want to | run |
# |---|---|
# | read and run the notebooks | `make lab` |
# | run the tests in `tests/` (the package's, and checks of the notebooks and the site) | `make unit` |
# | run every check CI runs (it also needs a Chromium and npm; `make preflight` says what is missing) | `make test` |
# | bring a `.py`/`.ipynb` pair together after editing one | `make sync` |
# | write the package from the notebooks | `make export` |
# | re-run notebooks and store their outputs | `make execute NB="01"` |
# | build the static site into `site/` | `make html` |
#
# CI re-executes every notebook with **nbval**, a pytest plugin that runs each code cell again
# and compares the text of its outputs with the text stored in the `.ipynb` ("strict mode": any
# difference fails; the course's sanitizer, `tests/nbval_sanitize.cfg`, first replaces memory
# addresses, which differ on every run). Figures are not compared, so a changed picture
# passes; everything *printed* here must come out the same on every run. Three habits make that
# work: fixed seeds; rounded prints; and, on a cell whose output depends on the machine (versions,
# timings), the tag `nbval-ignore-output`, which tells nbval not to compare that cell, followed
# by a cell whose `assert` checks what matters.
#
# The pairing is done by **jupytext**; the export by a script, `tools/export.py`.

# %% [markdown]
# This notebook writes the package's first module, `utils`: the line `#| default_exp utils`
# below names the module that the notebook's `#| export` cells go to.

# %%
#| default_exp utils

# %%
#| export
"""Small helpers every notebook uses: device choice, seeding, add_to_class, saving figures."""

import random
from collections.abc import Callable
from pathlib import Path

import torch

# %% [markdown]
# ## Versions
#
# A report of what you are running goes at the top of any bug report. It differs between
# machines, so the cell is tagged `nbval-ignore-output`: CI runs it but does not compare what it
# prints. The `assert` in the next cell checks the version the course needs: torch 2.5 or newer.

# %% tags=["nbval-ignore-output"]
import platform

import matplotlib
import numpy as np

print(f"python      {platform.python_version()}")
print(f"torch       {torch.__version__}")
print(f"numpy       {np.__version__}")
print(f"matplotlib  {matplotlib.__version__}")
print(f"cuda        {torch.cuda.is_available()}")

# %%
torch_major_minor = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
assert torch_major_minor >= (2, 5), "the course needs torch 2.5 or newer"


# %% [markdown]
# ## Choosing a device
#
# The same notebooks run on a laptop CPU, on an Apple GPU (`mps`) and on Colab's NVIDIA GPU
# (`cuda`). We ask for the best one available, in that order of preference: CUDA, then MPS, then
# the CPU. Every notebook makes this choice once, at its top: `device = get_device()`. You can
# also name a device, `get_device("cpu")`, to run on the CPU although a GPU is there. A device
# named must be one this machine has: `cpu` and `meta` always, `cuda` and `mps` when PyTorch
# finds them, and any other accelerator (`xpu`, `mtia`, ...) when its module in PyTorch
# (`torch.xpu`, ...) reports it available. Anything else (a device this machine lacks, or a type
# that PyTorch has no module to ask about) is refused, not swapped for another one: a run that
# silently fell back to the CPU would only look slow.

# %%
#| export
def get_device(prefer: str | torch.device | None = None) -> torch.device:
    """The best available device: cuda, then mps, then cpu. `prefer` names one instead ("cpu",
    "cuda:1", a torch.device), which must exist on this machine: cpu and meta always do; cuda and
    mps when PyTorch finds them; another type (xpu, mtia, ...) when torch.<type>.is_available()
    says so. A device index must be below the type's device_count() where torch has one."""
    has_cuda = torch.cuda.is_available()
    has_mps = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    if prefer is None:
        return torch.device("cuda" if has_cuda else "mps" if has_mps else "cpu")
    if not isinstance(prefer, (str, torch.device)):
        raise TypeError(
            "prefer must be a device name or a torch.device, "
            f"got {type(prefer).__name__} {prefer!r}"
        )
    try:
        device = torch.device(prefer)
    except RuntimeError:  # torch's own message lists every device type it knows
        raise ValueError(
            f"prefer must name a device such as 'cpu', 'cuda' or 'mps', got {prefer!r}"
        ) from None
    if device.type in ("cpu", "meta"):
        return device
    if device.type == "mps":
        available, device_count = has_mps, None
    else:  # cuda, and any other accelerator that has a module in torch (torch.xpu, ...)
        module = getattr(torch, device.type, None)
        is_available = getattr(module, "is_available", None)
        if not callable(is_available):
            raise ValueError(
                f"prefer={prefer!r}, but PyTorch has no torch.{device.type}.is_available() to "
                "say whether this machine has that device"
            )
        available = is_available()
        device_count = getattr(module, "device_count", None)
    if not available:
        raise ValueError(f"prefer={prefer!r}, but this machine has no {device.type} device")
    if device_count is not None and (device.index or 0) >= device_count():
        raise ValueError(
            f"prefer={prefer!r}, but this machine's {device.type} devices are numbered 0 to "
            f"{device_count() - 1}"
        )
    return device


# %% [markdown]
# **Check** the order of preference, and what happens to a device asked for by name. The
# machines are pretended: `mock.patch` swaps what PyTorch reports as available (CUDA, MPS, and
# Intel's `xpu` for the other accelerators), so the cell tests the same cases, and prints the
# same refusals, on a laptop and on a GPU server.

# %%
import contextlib
from unittest import mock


@contextlib.contextmanager
def pretend(cuda: bool, mps: bool, xpu: bool = False):
    """Inside, PyTorch reports CUDA (one device), MPS and XPU (one device) as available or not,
    as given, and has no module torch.xla (as where the torch_xla package is not installed)."""
    with (mock.patch("torch.xla", None, create=True),
          mock.patch("torch.cuda.is_available", return_value=cuda),
          mock.patch("torch.cuda.device_count", return_value=int(cuda)),
          mock.patch("torch.backends.mps.is_available", return_value=mps),
          mock.patch("torch.xpu.is_available", return_value=xpu),
          mock.patch("torch.xpu.device_count", return_value=int(xpu))):
        yield


device = get_device()
# On this machine: CUDA whenever there is one, and never where there is none.
assert (device.type == "cuda") == torch.cuda.is_available()
for has_cuda, has_mps, best in ((True, True, "cuda"), (False, True, "mps"), (False, False, "cpu")):
    with pretend(has_cuda, has_mps):
        assert get_device() == torch.device(best), (has_cuda, has_mps)
# A device named is returned as named when the machine has it: "meta" (shapes without data)
# exists on every machine, "cuda:0" on one with a GPU, "xpu" on one with an Intel GPU.
with pretend(cuda=True, mps=False):
    assert get_device("meta") == torch.device("meta") and get_device("cpu") == torch.device("cpu")
    assert get_device(torch.device("cuda", 0)) == torch.device("cuda:0")
with pretend(cuda=False, mps=False, xpu=True):
    assert get_device("xpu") == torch.device("xpu")
# ... and refused, with the policy of the next section, when it does not: also an accelerator
# that PyTorch has no module to ask about ("xla" needs the separate torch_xla package).
refusals = []
for cuda, mps, asked, expected in ((False, False, "cuda", ValueError), (True, False, "cuda:1", ValueError),
                                   (False, False, "mps", ValueError), (False, False, "xpu", ValueError),
                                   (False, False, "xla", ValueError), (False, False, "gpu", ValueError),
                                   (False, False, 0, TypeError)):
    try:
        with pretend(cuda, mps):
            get_device(asked)
    except expected as err:
        assert "prefer" in str(err), str(err)  # the message names the argument
        machine = "one cuda device" if cuda else "no GPU"
        refusals.append(f"{machine:<15} get_device({asked!r}): {type(err).__name__}: {err}")
    else:
        raise AssertionError(f"get_device({asked!r}) was accepted")
print("\n".join(refusals))

# %% [markdown]
# The device this machine chose depends on the machine, so its printout is not compared either:

# %% tags=["nbval-ignore-output"]
print(device)

# %% [markdown]
# ## One policy for bad input
#
# A library that is used from notebooks meets every kind of mistake: a float where a length
# goes, a mask of the wrong shape, token ids from another vocabulary. The course answers each one
# the same way, before any work is done, with a message that names the argument and the value:
#
# - a value of the wrong **type** (a float length, a bool where a number goes, a list where a
#   tensor goes) raises `TypeError`;
# - a value of the right type but the wrong **value** (a length of 0, a probability of 1.5, a
#   shape that does not fit) raises `ValueError`.
#
# The helpers live in their own small module, `transformer_from_scratch.checks`, so that every
# module applies the policy in the same words. Their cells start with `#| export checks`: a
# name after the marker sends the cell to that module, `transformer_from_scratch/checks.py`,
# instead of the notebook's default, `utils`. This
# notebook needs one of them now, `check_int`, for whole numbers such as a seed or a number of
# layers. A number may arrive as a Python int, a NumPy integer (`np.int64(4)`, read from an
# array) or a 0-d tensor (`lengths.max()`); all three are accepted and returned as a plain Python
# `int`. A bool is never a number here, whether Python's, NumPy's or a bool tensor: `True`
# passed as a width is a mistake, not a 1.
#
# The cell opens with all of the module's imports: `check_int` needs `operator`, `sys` and
# `torch`; the rest serve the checks of Appendices A and B.

# %%
#| export checks
"""Input checks with one policy: TypeError for a wrong type, ValueError for a wrong value."""

import contextlib
import contextvars
import math
import numbers
import operator
import sys
from collections.abc import Iterator, Sequence

import torch


def _is_bool(value) -> bool:
    """Python's bool, NumPy's bool (`np.True_`) or a bool tensor."""
    numpy = sys.modules.get("numpy")  # a NumPy bool exists only once NumPy has been imported
    return (
        isinstance(value, bool)
        or (numpy is not None and isinstance(value, numpy.bool_))
        or (isinstance(value, torch.Tensor) and value.dtype == torch.bool)
    )


def check_int(name: str, value: int, minimum: int | None = None) -> int:
    """`value` as a Python int, >= `minimum`. A Python or NumPy integer, or a 0-d integer
    tensor; never a bool (Python's, NumPy's or a bool tensor)."""
    if _is_bool(value):  # str(), not repr(): NumPy 1 and 2 spell the repr of np.True_ differently
        raise TypeError(f"{name} must be an int, got the bool {value!s}")
    if isinstance(value, torch.Tensor) and value.dim() != 0:
        raise TypeError(f"{name} must be an int, got a tensor of shape {tuple(value.shape)}")
    try:
        value = operator.index(value)  # floats and float tensors refuse this
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return value


# %% [markdown]
# **Check:** each mistake gets the exception its kind calls for, and a message that names the
# argument; and the three kinds of integer pass, returned as plain Python ints.

# %%
import re


def refusal(label: str, call: Callable, expected: type[Exception]) -> str:
    """Run `call`, which must raise `expected` with a message naming the argument in `label`."""
    argument = re.match(r"\w+", label)[0]  # "num_layers" in "num_layers=2.0"
    try:
        call()
    except expected as err:
        assert re.search(rf"\b{argument}\b", str(err)), (label, str(err))
        return f"{label:<28} {type(err).__name__}: {err}"
    raise AssertionError(f"{label} was accepted")


int_mistakes = {  # the function just defined above, not the installed package's copy
    "num_layers=2.0": (lambda: check_int("num_layers", 2.0, minimum=1), TypeError),
    "num_layers=True": (lambda: check_int("num_layers", True, minimum=1), TypeError),
    "num_layers=tensor([2])": (lambda: check_int("num_layers", torch.tensor([2])), TypeError),
    "num_layers=0": (lambda: check_int("num_layers", 0, minimum=1), ValueError),
}
print("\n".join(refusal(label, call, expected) for label, (call, expected) in int_mistakes.items()))
# What passes: the three kinds of integer, returned as plain Python ints.
accepted_ints = (7, np.int64(7), torch.tensor(7))
assert all(check_int("T", n, minimum=1) == 7 and type(check_int("T", n)) is int for n in accepted_ints)


# %% [markdown]
# The other checks apply the same policy to other kinds of input: numbers in an interval
# (`check_float`, `check_probability`), flags (`check_bool`), choices among a few strings
# (`check_choice`), tensors (`check_tensor`) and attention masks (`check_mask`). Appendix A, at
# the end, defines and tests them; read each there when a later notebook first calls it.
#
# Where do the checks run? At the **public boundary**, the function or module a reader calls:
# once per call, not again in every layer the input passes through. Appendix B shows how
# (notebook 02 is the first to need it).

# %% [markdown]
# ## Seeding
#
# A neural network starts from random weights and is trained on random batches. To get the same
# numbers twice we seed every generator we use: Python's `random`, NumPy's and PyTorch's (on
# every device). `set_seed` checks the seed first, with `check_int`, and against NumPy's limit
# of $2^{32} - 1$, so that a bad seed is refused before any generator is seeded.
#
# `set_seed` goes to `utils` and `check_int` to `checks`. Where an exported cell uses a name
# that another module defines, the exporter writes the import: here it adds
# `from transformer_from_scratch.checks import check_int` to the imports of `utils.py`.

# %%
#| export
def set_seed(seed: int = 0) -> torch.Generator:
    """Seed Python's random, NumPy and PyTorch (all devices); return a CPU generator alike."""
    seed = check_int("seed", seed, minimum=0)
    if seed > 2**32 - 1:
        raise ValueError(f"seed must be at most 2**32 - 1 (NumPy's limit), got {seed}")
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)  # noqa: NPY002 (the legacy global stream is what we seed)
    except ImportError:  # numpy is optional for the package itself
        pass
    torch.manual_seed(seed)  # seeds CUDA and MPS too
    return torch.Generator().manual_seed(seed)


# %% [markdown]
# **Check:** the same seed gives the same numbers, a different seed different ones, in each of
# the three streams.

# %%
def draw():
    """One draw from each stream that set_seed seeds: PyTorch's, Python's and NumPy's."""
    return torch.randn(3), random.random(), np.random.rand()  # noqa: NPY002


set_seed(0)
a, a_python, a_numpy = draw()
set_seed(0)
b, b_python, b_numpy = draw()
set_seed(1)
c, c_python, c_numpy = draw()
assert torch.equal(a, b) and (a_python, a_numpy) == (b_python, b_numpy)
assert not torch.equal(a, c) and a_python != c_python and a_numpy != c_numpy
print(a.round(decimals=4))

# %% [markdown]
# The printed numbers repeat whenever the cell runs again with the same PyTorch version on the
# same kind of machine. PyTorch promises no more than that: its notes on reproducibility say
# that results can differ across releases and platforms even with the same seed (on the CPU,
# `torch.randn` itself has vectorised code paths that depend on the tensor's size and the
# processor). GPU generators are not the CPU one at all, so random data whose values show in a
# printed output is drawn on the CPU and then moved to the device. Dropout (notebook 06) is the
# exception: it draws its random mask on the device it runs on, and even on the CPU the mask
# can depend on the processor's maker (Appendix C).
#
# **Two ways to seed a draw.** `set_seed(0)` at the top of a notebook seeds the *global*
# streams, and every draw moves along them: what a cell draws depends on what ran before it.
# Where a draw must not depend on that, give it a generator of its own:
# `torch.randn(3, generator=torch.Generator().manual_seed(7))` draws the same numbers however
# the cells before it were run, and leaves the global stream where it was. Notebook 01 on does
# this for data it wants fixed. The generator that `set_seed` returns is such a generator, seeded
# like the global streams.
#
# **Check** the refusals too: a seed of the wrong type or out of range is refused before any
# generator is seeded (Python's stream is left as it was); a NumPy integer seeds like the same
# Python int; and the returned generator is a fresh one, seeded with the seed: drawing from it
# leaves the global stream where it was.

# %%
state_before = random.getstate()
seed_refusals = []
for bad_seed, error in ((2**32, ValueError), (-1, ValueError), (1.0, TypeError), (True, TypeError)):
    try:
        set_seed(bad_seed)
    except error as err:
        seed_refusals.append(f"set_seed({bad_seed!r}): {type(err).__name__}: {err}")
    else:
        raise AssertionError(f"set_seed accepted {bad_seed!r}")
print("\n".join(seed_refusals))
assert random.getstate() == state_before  # nothing was seeded
assert torch.equal(torch.rand(3, generator=set_seed(np.int64(3))), torch.rand(3, generator=set_seed(3)))
own = torch.Generator().manual_seed(5)
returned = set_seed(5)
global_state = torch.get_rng_state()
assert torch.equal(torch.rand(3, generator=returned), torch.rand(3, generator=own))
assert torch.equal(torch.get_rng_state(), global_state)  # not the global generator


# %% [markdown]
# ## Building a class one idea at a time
#
# A Transformer layer has a constructor, a forward pass and a few helpers. Written as one cell it
# is a wall of code; the course adds one method per cell instead, with `add_to_class`, the trick
# popularised by *Dive into Deep Learning*:

# %%
#| export
def add_to_class(cls: type) -> Callable:
    """Decorator: attach the decorated function to `cls` as a method of the same name."""

    def attach(fn: Callable) -> Callable:
        setattr(cls, fn.__name__, fn)
        return fn

    return attach


# %%
class Counter:
    def __init__(self):
        self.n = 0


@add_to_class(Counter)
def step(self, k: int = 1) -> int:
    self.n += k
    return self.n


counter = Counter()
counter.step()
assert counter.step(2) == 3
print(counter.n)


# %% [markdown]
# When `make export` writes the package, it folds each `@add_to_class` method back into its class,
# so `src/` reads as ordinary Python classes.

# %% [markdown]
# ## Figures
#
# Every idea in the course comes with a picture. Figures that the README or the site reuse are
# also saved as PNG files in `figures/` at the root of the repository. `save_figure` finds that
# folder from wherever the notebook runs: the nearest folder above that holds both `figures/`
# and `pyproject.toml` (the repository's root). Where there is none (on Colab), it quietly
# saves nothing.

# %%
#| export
def find_figures_dir(start: Path | None = None) -> Path | None:
    """The repository's figures/ folder, found upwards from `start` (default: the cwd)."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "figures").is_dir() and (folder / "pyproject.toml").is_file():
            return folder / "figures"
    return None


def save_figure(fig, name: str, directory: Path | None = None, dpi: int = 110) -> Path | None:
    """Save `fig` as figures/<name>.png in the repository; return the path (None if no repo)."""
    if not name or "/" in name or name.endswith(".png"):
        raise ValueError(f"name must be a bare file stem like 'softmax_saturation', got {name!r}")
    directory = directory if directory is not None else find_figures_dir()
    if directory is None:
        return None
    path = Path(directory) / f"{name}.png"
    # Fixed metadata: the same figure gives the same bytes, so git sees no change.
    fig.savefig(path, dpi=dpi, bbox_inches="tight", metadata={"Software": None})
    return path


# %% [markdown]
# A first figure, the course's colour rule. Four colours have a fixed meaning wherever they
# appear:
#
# | colour | means |
# |---|---|
# | blue | queries; and **our** implementation, in a figure that compares it with PyTorch's |
# | orange | keys; and **PyTorch's** built-in, in such a comparison |
# | green | values |
# | red | the accent: the one thing a figure wants you to look at |
#
# The rest of the rule, in short:
#
# - **Other series** (heads, layers, dimensions, variants such as "raw" against "scaled",
#   settings) take the other colours, `OTHER_COLORS`: purple, brown, pink, olive and cyan, in
#   that order. So blue, orange and green keep the meanings of the table and nothing else.
# - **One meaning per figure:** a figure uses blue for queries or for ours, not for both, and
#   orange for keys or for PyTorch's, not for both.
# - **Reference lines** (a theory curve, "uniform") are grey.
# - **Parts of a layer**, in the diagrams of notebooks 06-10, take `PART_COLORS`: some of the
#   other colours, a dark cyan for cross-attention, and greys for the embeddings and the output
#   head. (Notebook 07's activation figures keep colours of their own.)
# - **Heatmaps** use colour *maps* instead: a sequential one (`Blues`) for weights in $[0, 1]$, a
#   diverging one (`RdBu_r`, centred on zero) for signed numbers.

# %%
#| export
COLORS = {"query": "#1f77b4", "key": "#ff7f0e", "value": "#2ca02c", "ours": "#1f77b4",
          "torch": "#ff7f0e", "accent": "#d62728"}
# For series that are none of the above: matplotlib's tab10 from purple on, without its grey
# (#7f7f7f), which is kept for reference lines.
OTHER_COLORS = ("#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf")

# %% jupyter={"source_hidden": true}
import matplotlib.pyplot as plt
from matplotlib.colors import to_rgb


def relative_luminance(color) -> float:
    """WCAG 2's relative luminance: each sRGB channel linearised, then weighted (0 to 1)."""
    linear = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in to_rgb(color)]
    return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]


def text_color(color) -> str:
    """Black or white, whichever contrasts more with `color`: white below luminance 0.179."""
    return "white" if relative_luminance(color) < 0.179 else "black"


fig, (ax_roles, ax_other) = plt.subplots(2, 1, figsize=(6.5, 2.4))
rows = ((ax_roles, list(COLORS.items()), "COLORS: roles, the same colour in every notebook"),
        (ax_other, list(zip(["[0] purple", "[1] brown", "[2] pink", "[3] olive", "[4] cyan"],
                            OTHER_COLORS, strict=True)),
         "OTHER_COLORS[i]: every other series (heads, layers, variants)"))
for ax, entries, title in rows:
    for i, (name, color) in enumerate(entries):
        ax.barh(0, 1, left=i, color=color)
        ax.text(i + 0.5, 0, name, ha="center", va="center", color=text_color(color), fontsize=9)
    ax.set_xlim(0, len(COLORS))
    ax.set_axis_off()
    ax.set_title(title, fontsize=10)
fig.tight_layout()
saved = save_figure(fig, "course_colors")
plt.show()

# %% [markdown]
# **Check** `save_figure` and `find_figures_dir`, on a scratch folder: the file is a PNG, saving
# the same figure again gives the same bytes (no version or date is written into it, so git sees
# no change), and a name that is not a bare stem is refused. The figures folder is found from a
# folder inside the repository, but neither from outside one nor from a folder that has a
# `figures/` and no `pyproject.toml`. Then the figure above: it went to the `figures/` of the
# repository this notebook runs in. And the labels of the picture: black on a light colour,
# white on a dark one (Appendix D shows that every label is readable).

# %%
import tempfile

with tempfile.TemporaryDirectory() as scratch:
    repo = Path(scratch) / "repo"
    (repo / "figures").mkdir(parents=True)
    (repo / "pyproject.toml").touch()
    (repo / "notebooks" / "deep").mkdir(parents=True)
    assert find_figures_dir(repo / "notebooks" / "deep") == (repo / "figures").resolve()
    assert find_figures_dir(Path(scratch)) is None  # no repository above the scratch folder
    loose = Path(scratch) / "loose"  # a figures/ folder without a pyproject.toml beside it
    (loose / "figures").mkdir(parents=True)
    assert find_figures_dir(loose) is None

    first = save_figure(fig, "palette", directory=repo / "figures")
    png = first.read_bytes()
    assert first.name == "palette.png" and png.startswith(b"\x89PNG\r\n\x1a\n")
    assert b"matplotlib" not in png  # no "Software: matplotlib x.y" entry
    assert save_figure(fig, "palette", directory=repo / "figures").read_bytes() == png
    for bad in ("", "sub/palette", "palette.png"):
        try:
            save_figure(fig, bad, directory=repo / "figures")
        except ValueError:
            pass
        else:
            raise AssertionError(f"save_figure accepted the name {bad!r}")
# The figure above: in figures/ beside the pyproject.toml of a folder this notebook runs in
# (None only where there is no such folder, as on Colab).
if saved is not None:
    root = saved.parent.parent
    assert saved == root / "figures" / "course_colors.png" and saved.is_file()
    assert (root / "pyproject.toml").is_file() and Path.cwd().resolve().is_relative_to(root)
# The label colours: black on a light colour, white on a dark one.
assert text_color("white") == "black" and text_color("black") == "white"
assert [text_color(c) for c in (COLORS["query"], COLORS["accent"], OTHER_COLORS[3])] == [
    "white", "white", "black"]

# %% [markdown]
# ## Shapes and names
#
# The code uses the paper's names, and every reshape says what it does in a comment:
#
# | symbol | meaning |
# |---|---|
# | `B` | batch size |
# | `T`, `T_q`, `T_k` | sequence length; of the queries and of the keys/values when they differ |
# | `D`, `d_model` | width of the model (the vectors that flow between layers) |
# | `d_k`, `d_v` | width of a query/key and of a value |
# | `h`, `num_heads` | number of attention heads, each of width `d_k = d_model / h` |
#
# ## Recap
#
# | piece | where | what it gives |
# |---|---|---|
# | device choice | `get_device()`, `get_device("cpu")` | `cuda` → `mps` → `cpu`; a named device, if PyTorch reports this machine has it |
# | input checks | `check_int` here; `check_float`, `check_mask`, ... in Appendix A | `TypeError` for a wrong type, `ValueError` for a wrong value |
# | seeding | `set_seed(0)`; `torch.Generator().manual_seed(k)` | the same numbers on every run of the same setup (torch version, kind of machine) |
# | a class across cells | `@add_to_class(C)` | one idea per cell, ordinary classes in `src/` |
# | figures | `save_figure(fig, name)` | `figures/name.png`, reused by the README and site |
# | colours | `COLORS["query"]`, `OTHER_COLORS[0]` | roles; any other series |
# | tests | `tests/test_*.py`, `make unit` | the package checked apart from the notebooks |
#
# ## Exercises
#
# 1. Call `set_seed(0)` and draw `torch.rand(2)` twice in a row. Are the two draws equal? Why?
# 2. `add_to_class` returns the function it attaches. What would the name `step` be at the
#    top level of the notebook if it returned nothing? And if you want `@torch.no_grad()` on the
#    *method*, does it go above or below `@add_to_class(Counter)`?
#
# **Solutions.**
#
# 1. No. Seeding fixes the *start* of the stream; each draw moves along it. Seed again before
#    the second draw to repeat it:

# %%
set_seed(0)
first, second = torch.rand(2), torch.rand(2)
set_seed(0)
again = torch.rand(2)
assert not torch.equal(first, second) and torch.equal(first, again)


# %% [markdown]
# 2. A decorator's return value replaces the name it decorates. Returning nothing would leave
#    `step = None` at the top level, so the cell that taught the method could no longer call it
#    as a plain function. Decorators apply from the bottom up, so the one *below*
#    `@add_to_class` is applied first and its result is what the class receives: put
#    `@torch.no_grad()` there to decorate the method. Put above, it would only wrap the
#    top-level name, and the class would keep the undecorated function.

# %%
class Weights:
    def __init__(self):
        self.w = torch.ones(2, requires_grad=True)


@add_to_class(Weights)
@torch.no_grad()
def scaled(self, k: float) -> torch.Tensor:
    return k * self.w


@torch.no_grad()
@add_to_class(Weights)
def doubled(self) -> torch.Tensor:
    return 2 * self.w


holder = Weights()
assert not holder.scaled(3.0).requires_grad  # no_grad below add_to_class: the method has it
assert holder.doubled().requires_grad  # no_grad above: the class got the plain function
assert not doubled(holder).requires_grad  # ... and only the top-level name is wrapped


# %% [markdown]
# The appendices below are for later: each one is the detail behind a sentence above, for when
# a later notebook leans on it.
#
# ## Appendix A · The other input checks
#
# A float parameter (a learning rate, a probability) takes the three kinds of integer that
# `check_int` takes, and floating numbers of the same three kinds: `np.float32(0.1)` and
# `torch.tensor(0.1)` are numbers too. It must be finite, and it must lie in an interval whose
# ends may be open or closed (a dropout probability lies in $[0, 1)$):

# %%
#| export checks
def check_float(
    name: str,
    value: float,
    low: float = -math.inf,
    high: float = math.inf,
    *,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """`value` as a finite Python float in the interval from `low` to `high` (ends open or
    closed). A Python or NumPy number (integer or floating), or a 0-d integer or floating
    tensor; never a bool."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.dtype == torch.bool or value.is_complex():
            raise TypeError(
                f"{name} must be a number, got a tensor of dtype {value.dtype} and shape "
                f"{tuple(value.shape)}"
            )
        value = value.item()
    elif _is_bool(value):
        raise TypeError(f"{name} must be a number, got the bool {value!s}")
    elif not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    above = value > low if low_open else value >= low
    below = value < high if high_open else value <= high
    if not (above and below):
        if math.isinf(high):
            wanted = f"{'>' if low_open else '>='} {low:g}"
        elif math.isinf(low):
            wanted = f"{'<' if high_open else '<='} {high:g}"
        else:
            wanted = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise ValueError(f"{name} must be {wanted}, got {value!r}")
    return value


def check_probability(name: str, value: float) -> float:
    """A dropout or smoothing probability: a number in [0, 1)."""
    return check_float(name, value, 0.0, 1.0, high_open=True)


# %% [markdown]
# A flag must be a real `bool` (a `1` is refused, so that a number passed in the wrong position
# does not pass as `True`), and a choice must be one of a few strings, spelled exactly as listed:

# %%
#| export checks
def check_bool(name: str, value: bool) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def check_choice(name: str, value: str, choices: Sequence[str]) -> str:
    """`value`, if it is exactly one of `choices` (a value is stored as given, so it must match
    as given: "Adam" is not "adam")."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, one of {list(choices)}, got {type(value).__name__}")
    if value not in choices:
        hint = [c for c in choices if c.lower() == value.lower()]
        near = f" (choices are case-sensitive: did you mean {hint[0]!r}?)" if hint else ""
        raise ValueError(f"unknown {name} {value!r}; expected one of {list(choices)}{near}")
    return value


# %% [markdown]
# Last, tensors: `check_tensor` tests the kind of numbers and the number of dimensions, and
# `check_mask` tests an attention mask: bool or floating, and of a shape that broadcasts to the
# scores it will mask (masks arrive in notebook 05).

# %%
#| export checks
def check_tensor(
    name: str, x: torch.Tensor, dim: int | None = None, kind: str | None = None
) -> torch.Tensor:
    """x, if it is a tensor with `dim` dimensions of kind "float" or "int" (when given)."""
    if kind not in (None, "float", "int"):  # a misspelt kind would check nothing
        raise ValueError(f"kind must be 'float', 'int' or None, got {kind!r}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if kind == "float" and not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if kind == "int" and (x.dtype == torch.bool or x.is_floating_point() or x.is_complex()):
        raise TypeError(f"{name} must hold integers, got dtype {x.dtype}")
    if dim is not None and x.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(x.shape)}")
    return x


def check_mask(
    name: str,
    mask: torch.Tensor | None,
    shape: Sequence[int] | None = None,
    what: str = "",
    hint: str = "",
) -> None:
    """Raise unless `mask` is None or a bool/floating tensor that broadcasts to `shape`.

    A bool mask says True = may attend; a floating one is added to the scores. Any other dtype
    (a 0/1 integer mask, say) is a TypeError: added to the scores, it would mask nothing.
    `what` names `shape` in symbols for the message; `shape=None` checks the dtype only.
    """
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(
            f"{name} must be bool (True = may attend) or floating (added to the scores), "
            f"got dtype {mask.dtype}"
        )
    if shape is None:
        return
    shape = tuple(shape)
    try:
        fits = torch.broadcast_shapes(mask.shape, shape) == shape
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(
            f"{name} of shape {tuple(mask.shape)} does not broadcast to {what} = {shape}"
            + (f"; {hint}" if hint else "")
        )


# %% [markdown]
# **Check:** each mistake gets the exception its kind calls for, and a message that names the
# argument (the `refusal` helper of the main part asserts both); and the three kinds of number
# pass, returned as plain Python floats. NumPy's bool is among the mistakes because it must be
# named in `_is_bool`: NumPy 1 (which the course supports) lets it pass as an index,
# `operator.index(np.True_) == 1`, so `check_int` would otherwise take it for a 1. NumPy 2 refuses
# that, so under NumPy 2 the cell pretends to be NumPy 1 (`mock.patch` swaps `operator.index` for
# one that takes `np.True_` as 1): the refusal must then come from `_is_bool`, and its message
# says "the bool".

# %%
mistakes = {  # the functions just defined above, not the installed package's copies
    "num_layers=tensor(True)": (lambda: check_int("num_layers", torch.tensor(True)), TypeError),
    "dropout_p=1.0": (lambda: check_probability("dropout_p", 1.0), ValueError),
    "dropout_p='0.1'": (lambda: check_probability("dropout_p", "0.1"), TypeError),
    "dropout_p=np.True_": (lambda: check_probability("dropout_p", np.True_), TypeError),
    "lr=0.0, must be > 0": (lambda: check_float("lr", 0.0, 0.0, low_open=True), ValueError),
    "bias=1": (lambda: check_bool("bias", 1), TypeError),
    "activation='ReLU'": (lambda: check_choice("activation", "ReLU", ("relu", "gelu")), ValueError),
    "x=[[1.0]]": (lambda: check_tensor("x", [[1.0]], dim=2), TypeError),
    "x of shape (2, 3), 3-D": (lambda: check_tensor("x", torch.zeros(2, 3), dim=3), ValueError),
    "tokens of floats": (lambda: check_tensor("tokens", torch.zeros(2), kind="int"), TypeError),
    "mask (3, 5) for (2, 4, 5, 5)": (
        lambda: check_mask("mask", torch.ones(3, 5), (2, 4, 5, 5), "(B, h, T, T)"),
        ValueError,
    ),
    "mask of 0/1 integers": (
        lambda: check_mask("mask", torch.ones(5, 5, dtype=torch.int64), (2, 4, 5, 5), "(B, h, T, T)"),
        TypeError,
    ),
}
mistakes["num_layers=np.True_, NumPy 1"] = (
    lambda: check_int("num_layers", np.True_, minimum=1), TypeError)


def numpy1_index(value, index=operator.index):
    """operator.index as NumPy 1 has it: np.True_ passes as 1."""
    return 1 if isinstance(value, np.bool_) else index(value)


with mock.patch("operator.index", numpy1_index):
    assert operator.index(np.True_) == 1  # what check_int would take, were it not for _is_bool
    mistake_lines = [refusal(label, call, expected) for label, (call, expected) in mistakes.items()]
print("\n".join(mistake_lines))
assert all("got the bool True" in line for line in mistake_lines if "np.True_" in line)
# What passes: the three kinds of number, returned as plain Python floats.
accepted_floats = (0.5, np.float32(0.5), torch.tensor(0.5), *accepted_ints)
assert all(type(check_float("lr", x, 0.0, low_open=True)) is float for x in accepted_floats)
assert check_probability("dropout_p", np.float64(0.1)) == 0.1

# %% [markdown]
# ## Appendix B · Under the hood: `validated()`
#
# A Transformer's `forward` calls its stacks, which call blocks, which call attention, each of
# them public too. Checking the same mask in all of them would repeat the work several times per
# call. So an entry point that has checked its inputs opens `validated()`, and the ones it calls
# ask `checking()` before they check. The flag lives in a `contextvars.ContextVar` rather than a
# global variable, so that a thread (or an asyncio task) that opens `validated()` switches the
# checks off for itself only, not for another one running the model at the same time; and
# `reset(token)` restores the value from before, so `validated()` blocks nest.
#
# Under `torch.compile` the checks that ask `checking()` do not run: a compiled model answers a
# bad input with whatever error PyTorch raises deep inside, if any, so call the model once
# uncompiled when you want the course's message. The variable is not used there at all:
# `checking()` asks `torch.compiler.is_compiling()` first and is off while a function is traced,
# and `validated()` then sets nothing. The reason is the compiler's tracer, TorchDynamo: in torch 2.13 each call
# of a `ContextVar`'s `get`, `set` or `reset` is a graph break (the model is cut into separate
# graphs, with Python in between). `tests/test_checks.py` counts the graphs of a 2-layer
# Transformer: one as written below, more than 20 if the variable were used under the compiler.
# It asserts this from torch 2.13 on only: torch 2.5.1, the oldest the course supports, does
# not trace into `validated()` (a `contextlib` wrapper, which its tracer skips), and there the
# same model falls into 21 graphs, each break at a `validated()` block.

# %%
#| export checks
_VALIDATED = contextvars.ContextVar("transformer_from_scratch_validated", default=False)


@contextlib.contextmanager
def validated() -> Iterator[None]:
    """Inside, inputs were checked by an outer entry point: inner ones skip their checks."""
    if torch.compiler.is_compiling():  # checking() is off anyway; set() and reset() would each
        yield  # break the traced graph (torch 2.13's Dynamo cannot trace them)
        return
    token = _VALIDATED.set(True)
    try:
        yield
    finally:
        _VALIDATED.reset(token)


def checking() -> bool:
    """True unless an enclosing `validated()` block checked the inputs (or torch.compile traces).

    is_compiling() comes first: under torch.compile it short-circuits, so the trace never reads
    the context variable (torch 2.13's Dynamo cannot trace ContextVar.get: a graph break)."""
    return not (torch.compiler.is_compiling() or _VALIDATED.get())


# %% [markdown]
# **Check:** inside `validated()`, `checking()` is off; it is off in a nested block too, and on
# again once the outer block closes, also when the block ends with an exception. And while
# another thread sits inside `validated()`, this one still checks.

# %%
import threading

assert checking()
with validated():
    assert not checking()
    with validated():
        assert not checking()
    assert not checking()  # the inner block restored the outer value, not the default
assert checking()
try:
    with validated():
        raise KeyError("inside")
except KeyError:
    pass
assert checking()

inside, release = threading.Event(), threading.Event()


def hold_validated():
    with validated():
        inside.set()  # the other thread is now inside its validated() block...
        release.wait(timeout=10)


worker = threading.Thread(target=hold_validated)
worker.start()
assert inside.wait(timeout=10)
still_checking = checking()  # ...and this thread's flag is untouched
release.set()
worker.join()
assert still_checking and checking()

# %% [markdown]
# ## Appendix C · Dropout masks and the CPU's vendor
#
# Dropout (notebook 06) zeroes each entry of a tensor with probability $p$ during training; which
# entries it zeroes, its *mask*, is a random draw. A check or a figure that depends on one
# particular mask runs its dropout on the CPU, but even there "the same kind of machine" matters,
# and for dropout the deciding fact is the CPU's vendor. In ATen's `bernoulli_scalar_kernel`
# (`native/cpu/DistributionKernels.cpp`), which draws the mask, a build with Intel's MKL takes
# MKL's random stream (seeded from PyTorch's) only when the CPU is an Intel one; on any other
# CPU, and in builds without MKL, the mask comes from PyTorch's own generator: entry $i$ is kept
# when the $i$-th float64 `torch.rand` draw is below $1-p$ (so reads the kernel in the torch
# versions we checked; a release may change it). The cell below tests which stream your machine
# uses. On the machine that stored the course's outputs (vendor `AuthenticAMD`, torch 2.13
# built with MKL) it printed `True`; on an Intel CPU it may print `False`, and then the course's
# dropout masks differ from the stored ones. So a cell whose printout depends on a dropout mask is tagged
# `nbval-ignore-output`, like this one, and asserts what holds for any mask (here: about a
# fraction $1-p$ kept).

# %% tags=["nbval-ignore-output"]
n_draws, p_drop = 32768, 0.1
set_seed(0)
kept = torch.nn.functional.dropout(torch.ones(n_draws), p=p_drop, training=True) != 0
set_seed(0)
own_stream = torch.rand(n_draws, dtype=torch.float64) < 1 - p_drop  # PyTorch's generator
cpuinfo = Path("/proc/cpuinfo")  # Linux only; elsewhere only the architecture is known
lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
vendors = [line for line in lines if line.startswith("vendor_id")]
vendor = vendors[0].split(":")[1].strip() if vendors else f"vendor unknown ({platform.machine()})"
print(f"CPU {vendor}, torch {torch.__version__}, MKL {torch.backends.mkl.is_available()}")
print("dropout mask == (torch.rand(n, dtype=float64) < 1 - p):", torch.equal(kept, own_stream))
assert abs(kept.float().mean().item() - (1 - p_drop)) < 0.01  # any mask: ~1 - p kept (SD 0.002)


# %% [markdown]
# ## Appendix D · Readable labels
#
# The labels on the colour swatches are black or white, whichever contrasts more. `text_color`
# decides by WCAG's *relative luminance* $L$ (each sRGB channel linearised, then weighted):
# white (luminance 1) and black (0) contrast equally with a colour where
# $1.05/(L + 0.05) = (L + 0.05)/0.05$, that is at $L = \sqrt{1.05 \cdot 0.05} - 0.05 \approx
# 0.179$; below it white contrasts more. At that point both reach a contrast of
# $1.05/\sqrt{1.05 \cdot 0.05} \approx 4.58$, and away from it the better of the two does
# better still, so every label reaches WCAG's contrast of 4.5 for small text. A simpler rule,
# white where the *unlinearised* brightness $0.2126R + 0.7152G + 0.0722B$ is below 0.5, falls
# short on the course's green.

# %%
def contrast(color_a, color_b) -> float:
    """WCAG 2 contrast ratio of two colours: 1 (the same) to 21 (black on white)."""
    dark, light = sorted((relative_luminance(color_a), relative_luminance(color_b)))
    return (light + 0.05) / (dark + 0.05)


swatches = {**COLORS, **dict(zip(["purple", "brown", "pink", "olive", "cyan"], OTHER_COLORS, strict=True))}
ours_rule = {name: contrast(text_color(c), c) for name, c in swatches.items()}
simple_rule = {name: contrast("black" if 0.2126 * r + 0.7152 * g + 0.0722 * b > 0.5 else "white", c)
               for name, c in swatches.items() for r, g, b in [to_rgb(c)]}
print(f"lowest label contrast: text_color {min(ours_rule.values()):.2f}; the simpler rule "
      f"{min(simple_rule.values()):.2f}, on {min(simple_rule, key=simple_rule.get)}")
assert min(ours_rule.values()) >= 4.5 > min(simple_rule.values())  # WCAG AA for small text

# %% [markdown]
# Next: [01 · Attention](01_attention.ipynb), where the weighted average at the heart of the
# Transformer is built and its softmax taken apart.
