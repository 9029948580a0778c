"""Mending runs the model on copies that share its parameters (issue 58,
discover/weights.py): nothing of the model is copied twice, and nothing a run
writes reaches the user's model."""

import pytest
import torch

import graphmend
from graphmend.discover import weights
from graphmend.discover.weights import ParameterWritten, copy_of, private, writes_parameters
from graphmend.models.targets import Target


@pytest.fixture(autouse=True)
def _restore():
    yield
    graphmend.unmend()
    torch._dynamo.reset()


class Breaking(torch.nn.Module):
    """A break (a print), a parameter, a buffer the forward updates in place."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        h = self.lin(x)
        self.seen.add_(1)
        print("h", h.sum())
        return h.relu()


class WritesWeight(Breaking):
    """Its forward writes its own weight in place (an update under no_grad)."""

    def forward(self, x):
        with torch.no_grad():
            self.lin.weight.mul_(0.5)
        return super().forward(x)


class WritesWhenLarge(Breaking):
    """Writes its weight only on inputs whose sum is large: a first call on small
    inputs shows no write."""

    def forward(self, x):
        if x.sum() > 100:
            with torch.no_grad():
                self.lin.weight.add_(1)
        return super().forward(x)


class SwapsData(Breaking):
    """Swaps its weight's storage and flag (``.data = ...``, ``requires_grad_``)."""

    def forward(self, x):
        self.lin.weight.data = self.lin.weight.data * 2
        self.lin.bias.requires_grad_(False)
        return super().forward(x)


def _snapshot(model):
    return {k: (v, v.detach().clone(), v._version) for k, v in model.state_dict(keep_vars=True).items()}


def _unchanged(model, snapshot):
    now = model.state_dict(keep_vars=True)
    return all(now[k] is v and torch.equal(v.detach(), saved) and v._version == version
               for k, (v, saved, version) in snapshot.items())


def test_a_copy_shares_the_parameters_and_owns_the_buffers():
    model = Breaking()
    twin = copy_of(model, share=True)
    assert twin.lin.weight is model.lin.weight and twin.lin.bias is model.lin.bias
    assert twin.seen is not model.seen and twin.lin is not model.lin
    whole = copy_of(model, share=False)
    assert whole.lin.weight is not model.lin.weight


def test_mending_leaves_parameters_buffers_and_versions_of_the_users_model_as_they_were(capsys):
    model, x = Breaking(), torch.randn(2, 4)
    before = _snapshot(model)
    report = graphmend.mend(model, x)
    assert report.before.graphs == 2 and report.after.graphs == 1 and report.verified
    assert _unchanged(model, before)
    assert writes_parameters(model) is False
    assert capsys.readouterr().out == ""  # mending's own runs printed nothing of the user's


def test_a_model_that_writes_its_weights_is_copied_whole_and_its_weights_are_put_back():
    model, x = WritesWeight(), torch.randn(2, 4)
    before = _snapshot(model)
    weight = model.lin.weight.detach().clone()
    report = graphmend.mend(model, x)
    assert writes_parameters(model) is True
    assert report.verified and report.after.graphs == 1
    assert torch.equal(model.lin.weight.detach(), weight)  # the first run's write was put back
    now = model.state_dict(keep_vars=True)
    assert all(now[k] is v for k, (v, _, _) in before.items())
    # The mended model then does exactly what the original does, write included.
    eager = WritesWeight()
    with torch.no_grad():
        expected = eager(x)
        got = model(x)
    assert torch.equal(got, expected) and torch.equal(model.lin.weight, eager.lin.weight)


def test_a_swapped_storage_or_flag_is_put_back_after_every_run():
    model, x = SwapsData(), torch.randn(2, 4)
    storage, data = model.lin.weight.data_ptr(), model.lin.weight.detach().clone()
    report = graphmend.mend(model, x)
    assert report.verified
    assert model.lin.weight.data_ptr() == storage and torch.equal(model.lin.weight.detach(), data)
    assert model.lin.bias.requires_grad is True


def test_a_later_run_that_writes_a_parameter_the_first_did_not_stops_with_the_parameters_name():
    model = WritesWhenLarge()
    small, large = torch.ones(2, 4), torch.full((2, 4), 50.0)
    with private(Target("m", model, (small,))) as subject, torch.no_grad():
        subject.model(*subject.args)
    assert writes_parameters(model) is False
    with pytest.raises(ParameterWritten, match="'lin.weight'"):
        with private(Target("m", model, (large,))) as subject, torch.no_grad():
            subject.model(*subject.args)


def test_the_first_run_is_watched_even_when_it_raises():
    class Raises(WritesWeight):
        def forward(self, x):
            super().forward(x)
            raise ValueError("bad input")

    model = Raises()
    weight = model.lin.weight.detach().clone()
    with pytest.raises(ValueError, match="bad input"):
        with private(Target("m", model, (torch.randn(2, 4),))) as subject, torch.no_grad():
            subject.model(*subject.args)
    assert torch.equal(model.lin.weight.detach(), weight) and writes_parameters(model) is True


def test_an_out_argument_is_a_write():
    class Out(Breaking):
        def forward(self, x):
            torch.add(x[:, :4].sum(0), 1, out=self.lin.bias.data)
            return super().forward(x)

    model = Out()
    bias = model.lin.bias.detach().clone()
    with private(Target("m", model, (torch.randn(2, 4),))) as subject, torch.no_grad():
        subject.model(*subject.args)
    assert writes_parameters(model) is True and torch.equal(model.lin.bias.detach(), bias)
    assert weights._writes(torch.ops.aten.add.out) == ((1 << 30, "out"),)


def test_compile_of_a_model_that_writes_its_weights_matches_eager_call_for_call():
    model, twin, x = WritesWeight(), WritesWeight(), torch.randn(2, 4)
    compiled = graphmend.compile(model, backend="eager")
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(compiled(x), twin(x))
            assert torch.equal(model.lin.weight, twin.lin.weight)
    assert compiled.report.verified
