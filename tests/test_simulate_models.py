"""The paper's four ImageNet networks (lightning_spdkfac.simulate.models): published parameter counts,
the K-FAC layers and factor sizes the simulator reads from them, and shapes from a forward on the meta
device. Everything except the CPU smoke test is computed on meta tensors (no memory allocated)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_spdkfac.kfac.layers import make_helper
from lightning_spdkfac.simulate import models
from lightning_spdkfac.simulate.models import PAPER_MODELS, densenet201, inception_v4, resnet50, resnet152

NAMES = ("resnet50", "resnet152", "densenet201", "inception_v4")


def _meta(ctor, *args) -> nn.Module:
    with torch.device("meta"):
        return ctor(*args)


def _record(store: dict, key, take):
    """A forward hook that stores ``take(inputs, output)`` under ``key`` and returns None (a hook that
    returns a value would replace the module's output)."""

    def hook(module, inputs, output):
        store[key] = take(inputs, output)

    return hook


def _n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _kfac_layers(model: nn.Module):
    """(module, helper) for each layer the K-FAC discovery supports, in module order."""
    out = []
    for mod in model.modules():
        helper, reason = make_helper(mod)
        assert reason is None, f"{type(mod).__name__} rejected by K-FAC: {reason}"
        if helper is not None:
            out.append((mod, helper))
    return out


def _triangles(layers) -> tuple[int, int, int]:
    """Sum over layers of n(n+1)/2 for the A and the G factor, and the largest factor side."""
    a = sum(h.a_dim * (h.a_dim + 1) // 2 for _, h in layers)
    g = sum(h.g_dim * (h.g_dim + 1) // 2 for _, h in layers)
    return a, g, max(max(h.a_dim, h.g_dim) for _, h in layers)


def test_paper_models_table():
    assert set(PAPER_MODELS) == set(NAMES)
    expected = {
        "resnet50": (resnet50, (3, 224, 224), 32),
        "resnet152": (resnet152, (3, 224, 224), 8),
        "densenet201": (densenet201, (3, 224, 224), 16),
        "inception_v4": (inception_v4, (3, 299, 299), 16),
    }
    assert PAPER_MODELS == expected
    assert set(models.__all__) == {*NAMES, "PAPER_MODELS"}


# Published figures: torchvision's ResNet-50/152 v1.5 and DenseNet-201 model cards; Inception-v4 with a
# 1000-way fc as in pytorchcv's and keras-hub's InceptionV4 (42,679,816). The 1001-class model (TF-slim
# label set with a background class) only adds one fc row: 1536 weights + 1 bias.
@pytest.mark.parametrize(
    "ctor, classes, expected",
    [
        (resnet50, 1000, 25_557_032),
        (resnet152, 1000, 60_192_808),
        (densenet201, 1000, 20_013_928),
        (inception_v4, 1000, 42_679_816),
        (inception_v4, 1001, 42_679_816 + 1536 + 1),
    ],
    ids=["resnet50", "resnet152", "densenet201", "inception_v4", "inception_v4_1001"],
)
def test_parameter_count_matches_published(ctor, classes, expected):
    model = _meta(ctor, classes)
    assert all(p.is_meta for p in model.parameters()), "construction under torch.device('meta') allocated"
    assert _n_params(model) == expected


def test_layer_types_are_standard_and_convs_bias_free():
    """Only standard layers; every conv is bias-free with groups=1; exactly one Linear, with bias; every
    conv feeds (or, in DenseNet, is fed by) a BatchNorm, so there is one BatchNorm per conv."""
    allowed = (
        nn.Conv2d, nn.Linear, nn.BatchNorm2d, nn.ReLU, nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d,
    )
    for name in NAMES:
        model = _meta(PAPER_MODELS[name][0])
        leaves = [m for m in model.modules() if not list(m.children())]
        odd = {type(m).__name__ for m in leaves if not isinstance(m, allowed)}
        assert not odd, f"{name}: non-standard leaf modules {odd}"
        convs = [m for m in leaves if isinstance(m, nn.Conv2d)]
        fcs = [m for m in leaves if isinstance(m, nn.Linear)]
        bns = [m for m in leaves if isinstance(m, nn.BatchNorm2d)]
        assert all(c.bias is None and c.groups == 1 for c in convs), name
        assert len(fcs) == 1 and fcs[0].bias is not None and fcs[0].out_features == 1000, name
        # DenseNet has one extra BatchNorm (norm5) before the classifier, and its BN precedes each conv.
        assert len(bns) == len(convs) + (name == "densenet201"), name


# (convs + fc, A-triangle total, G-triangle total, largest factor side), from the architectures:
# ResNet-50: stem + 16 blocks x 3 + 4 shortcuts = 53 convs; ResNet-152: stem + 50 x 3 + 4 = 155;
# DenseNet-201: stem + 2 x 98 dense layers + 3 transitions = 200; Inception-v4: stem 11, A 4x7,
# Reduction-A 4, B 7x10, Reduction-B 6, C 3x10 = 149.
KFAC = {
    "resnet50": (54, 62_348_671, 14_618_356, 4608),
    "resnet152": (156, 161_955_199, 32_927_476, 4608),
    "densenet201": (201, 130_961_295, 1_806_420, 1921),
    "inception_v4": (150, 116_414_683, 4_695_748, 3456),
}


@pytest.mark.parametrize("name", NAMES)
def test_kfac_layers_and_factor_sizes(name):
    layers = _kfac_layers(_meta(PAPER_MODELS[name][0]))
    n, a_tot, g_tot, largest = KFAC[name]
    assert len(layers) == n
    assert sum(isinstance(m, nn.Linear) for m, _ in layers) == 1
    assert isinstance(layers[-1][0], nn.Linear), "the fc comes last in module order"
    assert _triangles(layers) == (a_tot, g_tot, largest)


def test_resnet50_factor_sizes_match_paper():
    """The SPD-KFAC paper's ResNet-50 figures: 54 K-FAC layers, upper triangles of 62.35 M (A) and
    14.62 M (G) elements, largest factor 4608 (the 3x3 convs of the last stage: 512 * 9)."""
    layers = _kfac_layers(_meta(resnet50))
    assert len(layers) == 54
    assert sum(isinstance(m, nn.Conv2d) for m, _ in layers) == 53
    fc = layers[-1][1]
    assert (fc.a_dim, fc.g_dim) == (2048 + 1, 1000)  # the fc's bias adds one A row/column
    a, g, largest = _triangles(layers)
    assert round(a / 1e6, 2) == 62.35
    assert round(g / 1e6, 2) == 14.62
    assert largest == 4608
    assert [h.a_dim for _, h in layers].count(4608) == 3


# (module path whose input is the final feature map, its shape per sample)
FINAL_MAPS = {
    "resnet50": ("avgpool", (2048, 7, 7)),
    "resnet152": ("avgpool", (2048, 7, 7)),
    "densenet201": ("avgpool", (1920, 7, 7)),
    "inception_v4": ("avgpool", (1536, 8, 8)),
}


@pytest.mark.parametrize("name", NAMES)
def test_meta_forward_shapes(name):
    ctor, chw, batch = PAPER_MODELS[name]
    path, fmap = FINAL_MAPS[name]
    seen = {}
    with torch.device("meta"):
        model = ctor()
        model.get_submodule(path).register_forward_hook(_record(seen, "in", lambda i, o: tuple(i[0].shape)))
        y = model(torch.empty(batch, *chw))
    assert y.is_meta
    assert tuple(y.shape) == (batch, 1000)
    assert seen["in"] == (batch, *fmap)


def test_inception_v4_grid_sizes():
    """Stem 35x35x384, Reduction-A 17x17x1024, Reduction-B 8x8x1536 (Fig. 9 of Szegedy et al.)."""
    model = _meta(inception_v4)
    feats = model.features
    assert len(feats) == 1 + 4 + 1 + 7 + 1 + 3
    shapes = {}
    for idx in (0, 4, 5, 12, 13, 16):
        feats[idx].register_forward_hook(_record(shapes, idx, lambda i, o: tuple(o.shape[1:])))
    with torch.device("meta"):
        model(torch.empty(2, 3, 299, 299))
    assert shapes == {
        0: (384, 35, 35), 4: (384, 35, 35), 5: (1024, 17, 17),
        12: (1024, 17, 17), 13: (1536, 8, 8), 16: (1536, 8, 8),
    }


def test_densenet201_block_widths():
    """Channels after each dense block: 64+6*32=256, 128+12*32=512, 256+48*32=1792, 896+32*32=1920."""
    model = _meta(densenet201)
    widths = {}
    for i in range(1, 5):
        blk = model.features.get_submodule(f"denseblock{i}")
        blk.register_forward_hook(_record(widths, i, lambda inp, o: tuple(o.shape[1:])))
    with torch.device("meta"):
        model(torch.empty(1, 3, 224, 224))
    assert widths == {1: (256, 56, 56), 2: (512, 28, 28), 3: (1792, 14, 14), 4: (1920, 7, 7)}


@pytest.mark.parametrize(
    "name, hw", [("resnet50", 32), ("resnet152", 32), ("densenet201", 32), ("inception_v4", 75)]
)
def test_cpu_forward_backward_smoke(name, hw):
    """Real tensors at a small resolution (75 is the smallest Inception-v4 accepts): a finite output and
    a gradient for the weight of every K-FAC layer, so the modules are trainable, not only shape models."""
    torch.manual_seed(0)
    model = PAPER_MODELS[name][0]()
    y = model(torch.randn(2, 3, hw, hw))
    assert y.shape == (2, 1000) and torch.isfinite(y).all()
    y.square().mean().backward()
    for mod, _ in _kfac_layers(model):
        assert mod.weight.grad is not None and torch.isfinite(mod.weight.grad).all()


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="layers must be four block counts"):
        models.ResNet((3, 4, 6))
    with pytest.raises(ValueError, match=r"layers\[1\] must be an integer >= 1, got 0"):
        models.ResNet((3, 0, 6, 3))
    with pytest.raises(TypeError, match=r"layers\[0\] must be an integer"):  # a wrong type: TypeError
        models.ResNet((3.0, 4, 6, 3))
    with pytest.raises(TypeError, match="layers must be a sequence"):
        models.ResNet(3)
    with pytest.raises(ValueError, match=r"compression must be a number in \(0, 1\], got 0.0"):
        models.DenseNet(compression=0.0)
    with pytest.raises(TypeError, match="compression must be a number"):
        models.DenseNet(compression="half")


def test_resnet_is_v1_5_stride_on_3x3():
    """v1.5: the first block of stages 2-4 strides in its 3x3 conv, so its 1x1 reduce conv still sees the
    full grid (v1 strides the 1x1 conv: same parameters and factors, but 4x fewer A rows there)."""
    model = _meta(resnet50)
    out = {}
    for stage in ("layer2", "layer3", "layer4"):
        blk = model.get_submodule(stage)[0]
        for conv in ("conv1", "conv2"):
            blk.get_submodule(conv).register_forward_hook(_record(out, (stage, conv), lambda i, o: o.shape[-1]))
    with torch.device("meta"):
        model(torch.empty(1, 3, 224, 224))
    assert out == {
        ("layer2", "conv1"): 56, ("layer2", "conv2"): 28,
        ("layer3", "conv1"): 28, ("layer3", "conv2"): 14,
        ("layer4", "conv1"): 14, ("layer4", "conv2"): 7,
    }
