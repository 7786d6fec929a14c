"""transformer_from_scratch.utils (notebook 00; PART_COLORS: notebook 06)."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from transformer_from_scratch import utils  # noqa: E402


def test_get_device_prefers_what_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert utils.get_device() == torch.device("cpu")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert utils.get_device() == torch.device("mps")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert utils.get_device() == torch.device("cuda")
    assert utils.get_device("cpu") == torch.device("cpu")


def test_get_device_returns_a_named_device_that_exists(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert utils.get_device("cuda:1") == torch.device("cuda:1")
    assert utils.get_device(torch.device("cuda")) == torch.device("cuda")
    assert utils.get_device("meta") == torch.device("meta")


@pytest.mark.parametrize(
    "prefer, error, match",
    [
        ("cuda", ValueError, r"prefer='cuda', but this machine has no cuda device"),
        ("mps", ValueError, r"prefer='mps', but this machine has no mps device"),
        ("gpu", ValueError, r"prefer must name a device such as 'cpu', 'cuda' or 'mps', got 'gpu'"),
        (0, TypeError, r"prefer must be a device name or a torch.device, got int 0"),
        (["cpu"], TypeError, r"prefer must be a device name or a torch.device, got list"),
    ],
)
def test_get_device_refuses_what_this_machine_lacks(prefer, error, match, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(error, match=match):
        utils.get_device(prefer)


def test_get_device_refuses_a_cuda_index_beyond_the_devices(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    message = r"prefer='cuda:1', but this machine's cuda devices are numbered 0 to 0"
    with pytest.raises(ValueError, match=message):
        utils.get_device("cuda:1")


def test_get_device_asks_the_module_of_another_accelerator(monkeypatch):
    monkeypatch.setattr(torch.xpu, "is_available", lambda: True)
    monkeypatch.setattr(torch.xpu, "device_count", lambda: 2)
    assert utils.get_device("xpu:1") == torch.device("xpu:1")
    message = r"prefer='xpu:2', but this machine's xpu devices are numbered 0 to 1"
    with pytest.raises(ValueError, match=message):
        utils.get_device("xpu:2")
    monkeypatch.setattr(torch.xpu, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"prefer='xpu', but this machine has no xpu device"):
        utils.get_device("xpu")


def test_get_device_refuses_a_type_torch_has_no_module_to_ask_about(monkeypatch):
    monkeypatch.setattr(torch, "xla", None, raising=False)
    message = r"prefer='xla', but PyTorch has no torch.xla.is_available\(\) to say"
    with pytest.raises(ValueError, match=message):
        utils.get_device("xla")


def test_set_seed_repeats_every_stream():
    import random

    g1 = utils.set_seed(3)
    a = (random.random(), np.random.rand(), torch.rand(2), torch.rand(2, generator=g1))
    g2 = utils.set_seed(3)
    b = (random.random(), np.random.rand(), torch.rand(2), torch.rand(2, generator=g2))
    assert a[0] == b[0] and a[1] == b[1]
    assert torch.equal(a[2], b[2]) and torch.equal(a[3], b[3])
    utils.set_seed(4)
    assert not torch.equal(torch.rand(2), a[2])


@pytest.mark.parametrize(
    "bad, error, match",
    [
        (-1, ValueError, "seed must be at least 0, got -1"),
        (2**32, ValueError, r"seed must be at most 2\*\*32 - 1 \(NumPy's limit\), got 4294967296"),
        (1.5, TypeError, "seed must be an int, got float"),
        ("0", TypeError, "seed must be an int, got str"),
        (None, TypeError, "seed must be an int, got NoneType"),
        (True, TypeError, "seed must be an int, got the bool True"),
        (np.True_, TypeError, "seed must be an int, got the bool True"),  # NumPy 1 and 2 alike
        (torch.tensor(True), TypeError, "seed must be an int, got the bool"),
    ],
)
def test_set_seed_rejects_bad_seeds(bad, error, match):
    # the policy of checks (set_seed calls check_int): TypeError for a wrong type (once a
    # ValueError for 1.5), ValueError for a wrong value; refused before anything is seeded
    import random

    state = random.getstate()
    with pytest.raises(error, match=match):
        utils.set_seed(bad)
    assert random.getstate() == state


def test_set_seed_takes_numpy_and_tensor_integers_like_ints():
    expected = torch.rand(3, generator=utils.set_seed(2**32 - 1))
    for seed in (np.int64(2**32 - 1), np.uint32(2**32 - 1), torch.tensor(2**32 - 1)):
        assert torch.equal(torch.rand(3, generator=utils.set_seed(seed)), expected)


def test_add_to_class_attaches_and_returns_the_function():
    class C:
        pass

    @utils.add_to_class(C)
    def double(self, x):
        return 2 * x

    assert C().double(4) == 8
    assert double(None, 5) == 10


def test_save_figure_writes_png_and_is_reproducible(tmp_path):
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    first = utils.save_figure(fig, "line", directory=tmp_path)
    data = first.read_bytes()
    second = utils.save_figure(fig, "line", directory=tmp_path)
    plt.close(fig)
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert second.read_bytes() == data  # same figure, same bytes: no churn in git


def test_save_figure_without_a_repository_does_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fig = plt.figure()
    assert utils.save_figure(fig, "nothing") is None
    plt.close(fig)


@pytest.mark.parametrize("bad", ["", "a/b", "x.png"])
def test_save_figure_rejects_paths(bad, tmp_path):
    fig = plt.figure()
    with pytest.raises(ValueError, match="bare file stem"):
        utils.save_figure(fig, bad, directory=tmp_path)
    plt.close(fig)


def test_find_figures_dir(tmp_path):
    (tmp_path / "figures").mkdir()
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / "notebooks").mkdir()
    assert utils.find_figures_dir(tmp_path / "notebooks") == tmp_path / "figures"
    (tmp_path / "other").mkdir()
    assert utils.find_figures_dir(tmp_path / "other") == tmp_path / "figures"


def test_find_figures_dir_needs_a_pyproject_beside_figures(tmp_path):
    (tmp_path / "loose" / "figures").mkdir(parents=True)  # figures/, but no pyproject.toml
    assert utils.find_figures_dir(tmp_path / "loose") is None
    (tmp_path / "pyproject.toml").write_text("")  # a repository above, without figures/
    assert utils.find_figures_dir(tmp_path / "loose") is None
    (tmp_path / "figures").mkdir()
    assert utils.find_figures_dir(tmp_path / "loose") == tmp_path / "figures"


def test_colors_are_hex():
    assert all(c.startswith("#") and len(c) == 7 for c in utils.COLORS.values())


def test_other_colors_never_reuse_a_role_colour():
    assert len(utils.OTHER_COLORS) == len(set(utils.OTHER_COLORS)) >= 5
    assert all(c.startswith("#") and len(c) == 7 for c in utils.OTHER_COLORS)
    assert not set(utils.OTHER_COLORS) & set(utils.COLORS.values())


def test_part_colors_one_distinct_colour_per_part_and_no_role_colour():
    parts = {
        "embedding",
        "positional",
        "attention",
        "cross_attention",
        "ffn",
        "layer_norm",
        "dropout",
        "head",
    }
    assert set(utils.PART_COLORS) == parts
    colours = list(utils.PART_COLORS.values())
    assert all(matplotlib.colors.is_color_like(c) for c in colours)
    assert all(c.startswith("#") and len(c) == 7 for c in colours)
    assert len(set(colours)) == len(colours)  # no two parts share a colour
    assert not set(colours) & set(utils.COLORS.values())  # the role colours keep their roles
    assert utils.PART_COLORS["layer_norm"] == "#9467bd"  # purple since notebook 06's first figure


def test_atomic_open_writes_text_and_bytes_and_leaves_no_temporary_file(tmp_path):
    with utils.atomic_open(tmp_path / "sub" / "a.txt", "w", encoding="utf-8") as f:
        f.write("zweiundvierzig")
    with utils.atomic_open(tmp_path / "b.bin") as f:
        f.write(b"\x00\x01")
    assert (tmp_path / "sub" / "a.txt").read_text(encoding="utf-8") == "zweiundvierzig"
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a.txt", "b.bin", "sub"]


def test_atomic_open_keeps_the_old_file_whole_when_the_write_fails(tmp_path):
    path = tmp_path / "state.json"
    path.write_text("old", encoding="utf-8")
    with pytest.raises(RuntimeError, match="disk full"):
        with utils.atomic_open(path, "w", encoding="utf-8") as f:
            f.write("new, but only half of")
            raise RuntimeError("disk full")
    assert path.read_text(encoding="utf-8") == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]  # the temporary file is gone


def test_atomic_open_refuses_modes_that_read_or_append(tmp_path):
    for mode in ("r", "a", "w+", "ab"):
        with pytest.raises(ValueError, match="mode"):
            with utils.atomic_open(tmp_path / "x", mode):
                pass
    assert list(tmp_path.iterdir()) == []
