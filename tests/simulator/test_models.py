import pytest
import torch

from simulator.models import build_model


@pytest.mark.parametrize("spec,shape,params", [
    ({"name": "logreg"}, (1, 8, 8), 64 * 10 + 10),
    ({"name": "mlp", "hidden": [32]}, (60,), 60 * 32 + 32 + 32 * 10 + 10),
    ({"name": "cnn", "channels": [4, 8], "hidden": 16}, (1, 8, 8), None),
])
def test_models_map_inputs_to_class_logits(spec, shape, params):
    m = build_model(spec, shape, 10, seed=0)
    assert m(torch.zeros(5, *shape)).shape == (5, 10)
    if params is not None:
        assert sum(p.numel() for p in m.parameters()) == params


def test_model_init_is_seeded_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = build_model({"name": "mlp", "hidden": [8]}, (4,), 3, seed=7)
    after = torch.rand(1)
    b = build_model({"name": "mlp", "hidden": [8]}, (4,), 3, seed=7)
    assert torch.equal(before, after)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_cnn_rejects_flat_input():
    with pytest.raises(ValueError, match=r"model: cnn needs image input \(C, H, W\)"):
        build_model({"name": "cnn"}, (60,), 10, seed=0)
