"""Unit tests of transformer_from_scratch.viz.plot_attention (notebook 02)."""

import matplotlib

matplotlib.use("Agg", force=True)  # no display: render off-screen

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402

from transformer_from_scratch.viz import plot_attention  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _weights(T_q=4, T_k=6):
    gen = torch.Generator().manual_seed(0)
    return torch.softmax(torch.randn(T_q, T_k, generator=gen), dim=-1)


def test_returns_axes_with_image_labels_and_colorbar():
    weights = _weights()
    keys = [f"k{j}" for j in range(6)]
    queries = [f"q{i}" for i in range(4)]
    ax = plot_attention(weights, keys, queries, title="t")
    assert isinstance(ax, Axes)
    assert len(ax.images) == 1
    np.testing.assert_allclose(ax.images[0].get_array(), weights.numpy(), rtol=1e-6)
    assert [t.get_text() for t in ax.get_xticklabels()] == keys
    assert [t.get_text() for t in ax.get_yticklabels()] == queries
    assert ax.get_title() == "t"
    assert ax.get_xlabel() and ax.get_ylabel()
    assert len(ax.figure.axes) == 2  # heatmap and colorbar
    assert ax.figure.axes[1].get_ylabel() == "attention weight"


def test_draws_on_given_axes_without_colorbar():
    fig, ax = plt.subplots()
    out = plot_attention(_weights(), ax=ax, colorbar=False)
    assert out is ax
    assert len(fig.axes) == 1


def test_square_weights_reuse_x_labels_on_y():
    tokens = ["the", "cat", "sat"]
    ax = plot_attention(_weights(3, 3), tokens)
    assert [t.get_text() for t in ax.get_yticklabels()] == tokens


def test_annotate_writes_one_number_per_finite_cell():
    weights = _weights(3, 4)
    weights[0, 0] = float("nan")  # a blank (masked) cell gets no number
    ax = plot_attention(weights, annotate=True)
    texts = [t.get_text() for t in ax.texts]
    assert len(texts) == 3 * 4 - 1
    assert f"{weights[1, 0].item():.2f}" in texts


def test_accepts_numpy_and_tensors_with_grad_and_scores_range():
    scores = torch.randn(5, 5, requires_grad=True)
    ax = plot_attention(scores * 2, cmap="RdBu_r", vmin=-3, vmax=3, label="score")
    assert ax.images[0].get_clim() == (-3, 3)
    ax = plot_attention(np.eye(3))
    assert ax.images[0].get_array().shape == (3, 3)


@pytest.mark.parametrize("shape", [(5,), (2, 3, 3), (1, 1, 4, 4)])
def test_non_2d_weights_raise(shape):
    with pytest.raises(ValueError, match=r"weights must be 2-D \(T_q, T_k\), got shape"):
        plot_attention(torch.rand(shape))


def test_label_length_mismatch_raises():
    with pytest.raises(ValueError, match=r"x_labels has 5 entries but weights of shape \(4, 6\)"):
        plot_attention(_weights(), x_labels=list("abcde"))
    with pytest.raises(ValueError, match=r"y_labels has 3 entries .* have 4 queries"):
        plot_attention(_weights(), x_labels=list("abcdef"), y_labels=list("abc"))
    with pytest.raises(ValueError, match="y_labels has 2 entries"):
        plot_attention(_weights(3, 3), x_labels=list("abc"), y_labels=list("ab"))


def _contrast(color_a, color_b) -> float:
    """WCAG 2 contrast ratio (1 to 21) of two colours, from their linearised luminance."""
    from matplotlib.colors import to_rgb

    lums = []
    for color in (color_a, color_b):
        c = np.asarray(to_rgb(color))
        c = np.where(c <= 0.04045, c / 12.92, ((c + 0.055) / 1.055) ** 2.4)
        lums.append(float(c @ [0.2126, 0.7152, 0.0722]))
    return (max(lums) + 0.05) / (min(lums) + 0.05)


@pytest.mark.parametrize(
    "cmap, vmin", [("Blues", 0.0), ("RdBu_r", -1.0), ("viridis", 0.0), ("magma", 0.0)]
)
def test_annotations_reach_wcag_aa_contrast_on_every_colour_of_the_map(cmap, vmin):
    values = torch.linspace(vmin, 1.0, 256).reshape(16, 16)  # every colour the map has
    ax = plot_attention(values, cmap=cmap, vmin=vmin, vmax=1.0, annotate=True)
    image = ax.images[0]
    colours = set()
    for text in ax.texts:
        column, row = (round(c) for c in text.get_position())
        cell = image.cmap(image.norm(values[row, column].item()))[:3]
        assert _contrast(text.get_color(), cell) >= 4.5, (cmap, values[row, column].item())
        colours.add(text.get_color())
    assert colours == {"white", "black"}
    plt.close(ax.figure)
