import pytest
import torch

from p2p_diloco.outer import optimizer as outer

pytestmark = pytest.mark.unit


def test_pseudo_gradient_sign_points_from_local_to_global():
    theta = [torch.tensor([1.0, 2.0])]
    local = [torch.tensor([0.5, 3.0])]  # inner training moved the weights
    out = [torch.empty(2)]
    outer.pseudo_gradient(theta, local, out)
    assert torch.equal(out[0], torch.tensor([0.5, -1.0]))
    # Outer SGD with lr 1 and no momentum (FedAvg) must land exactly on the local weights.
    opt = outer.OuterOptimizer(theta, lr=1.0, momentum=0.0)
    opt.step(out)
    assert torch.equal(theta[0], local[0])


def test_nesterov_matches_hand_computed_update():
    lr, mu = 0.7, 0.9
    theta = [torch.tensor([1.0, -2.0], dtype=torch.float64)]
    opt = outer.OuterOptimizer(theta, lr=lr, momentum=mu, nesterov=True)
    g1, g2 = torch.tensor([0.1, 0.2], dtype=torch.float64), torch.tensor([-0.3, 0.05], dtype=torch.float64)
    opt.step([g1])
    # round 1: buf = g1; update = g1 + mu * buf
    b1 = g1
    expected = torch.tensor([1.0, -2.0], dtype=torch.float64) - lr * (g1 + mu * b1)
    assert torch.allclose(theta[0], expected, rtol=0, atol=1e-15)
    opt.step([g2])
    b2 = mu * b1 + g2
    expected = expected - lr * (g2 + mu * b2)
    assert torch.allclose(theta[0], expected, rtol=0, atol=1e-15)
    assert torch.allclose(opt.momentum_buffers[0], b2, rtol=0, atol=1e-15)


def test_matches_torch_sgd_nesterov():
    torch.manual_seed(0)
    theta = [torch.randn(5, 3), torch.randn(7)]
    ref = [torch.nn.Parameter(t.clone()) for t in theta]
    sgd = torch.optim.SGD(ref, lr=0.7, momentum=0.9, nesterov=True)
    ours = outer.OuterOptimizer(theta, lr=0.7, momentum=0.9, nesterov=True)
    for _ in range(4):
        grads = [torch.randn_like(t) for t in theta]
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        sgd.step()
        ours.step(grads)
    for a, b in zip(theta, ref):
        assert torch.allclose(a, b.detach(), atol=1e-6)


def test_outer_step_is_bitwise_deterministic():
    torch.manual_seed(1)
    init = [torch.randn(64, 64), torch.randn(64)]
    deltas = [[torch.randn_like(t) for t in init] for _ in range(3)]
    digests = []
    for _ in range(2):
        theta = [t.clone() for t in init]
        opt = outer.OuterOptimizer(theta, 0.7, 0.9)
        for d in deltas:
            opt.step(d)
        digests.append(outer.digest(opt.state_tensors()))
    assert digests[0] == digests[1]


def test_digest_sees_one_bit():
    t = torch.randn(10)
    u = t.clone()
    u.view(torch.int32)[3] ^= 1
    assert outer.digest([t]) != outer.digest([u])
    assert outer.digest([t]) == outer.digest([t.clone()])


def test_state_round_trip_and_shape_check():
    theta = [torch.randn(3, 2)]
    opt = outer.OuterOptimizer(theta, 0.7, 0.9)
    opt.step([torch.ones(3, 2)])
    other = outer.OuterOptimizer([torch.zeros(3, 2)], 0.7, 0.9)
    other.load_state_tensors(opt.state_tensors())
    assert outer.digest(other.state_tensors()) == outer.digest(opt.state_tensors())
    with pytest.raises(ValueError):
        other.load_state_tensors([torch.zeros(2, 2), torch.zeros(2, 2)])


@pytest.mark.parametrize("nesterov,momentum", [(True, 0.9), (False, 0.9), (True, 0.0)])
def test_lookahead_is_the_step_that_would_follow_and_changes_nothing(nesterov, momentum):
    torch.manual_seed(1)
    theta = [torch.randn(6), torch.randn(2, 3)]
    opt = outer.OuterOptimizer(theta, lr=0.7, momentum=momentum, nesterov=nesterov)
    opt.step([torch.randn(6), torch.randn(2, 3)])  # non-zero momentum buffers
    before = [t.clone() for t in opt.state_tensors()]
    delta = [torch.randn(6), torch.randn(2, 3)]
    out = [torch.empty(6), torch.empty(2, 3)]
    opt.lookahead(delta, out)
    assert all(torch.equal(a, b) for a, b in zip(opt.state_tensors(), before)), "lookahead moved the outer state"
    opt.step(delta)
    assert all(torch.equal(a, b) for a, b in zip(out, theta)), "lookahead differs from the real step"
