"""Mending runs the model on copies that share its parameters (issue 58,
discover/weights.py): nothing of the model is copied twice, and nothing a run
writes reaches the user's model."""

import copy

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


class Config:
    """A plain configuration object, as transformers' are."""

    def __init__(self):
        self.scale = 2.0
        self.sizes = [4, 4]
        self.labels = {0: "a"}


class CopiesConfig(Breaking):
    """Its forward deep-copies its config (transformers' ``get_text_config``), which
    makes Dynamo guard the config's identity."""

    def __init__(self):
        super().__init__()
        self.config = Config()

    def forward(self, x):
        config = copy.deepcopy(self.config)
        return super().forward(x) * config.scale


class CountsInConfig(CopiesConfig):
    """Its forward changes its config: every call counts itself there."""

    def forward(self, x):
        self.config.sizes.append(len(self.config.sizes))
        self.config.calls = getattr(self.config, "calls", 0) + 1
        return super().forward(x)


def test_a_copy_shares_the_plain_data_its_modules_hold_and_copies_tensors_in_it():
    model = CopiesConfig()
    model.extra = [torch.zeros(1)]  # holds a tensor: not plain data, copied
    data = weights._Data.of(model)
    twin = copy_of(model, share=True, data=data)
    assert twin.config is model.config and twin.config.sizes is model.config.sizes
    assert twin.extra is not model.extra and twin.extra[0] is not model.extra[0]


def test_the_first_call_after_a_mend_of_a_model_that_copies_its_config_traces_nothing_again():
    """The mend's last trace was made on a copy; had the copy its own config, Dynamo's
    guard on the config's identity would fail on the user's model and the first call
    would trace and compile the frame again (a graph more than the report's)."""
    model, twin, x = CopiesConfig(), CopiesConfig(), torch.randn(2, 4)
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = graphmend.compile(model, backend=counting)
    with torch.no_grad():
        out = compiled(x)
        assert compiled.report.staged and compiled.report.after.graphs == 1
        assert len(graphs) == 1
        assert torch.equal(out, twin(x)) and torch.equal(compiled(x), twin(x)) and len(graphs) == 1
    assert model.config.scale == 2.0 and model.config.sizes == [4, 4]


def test_a_run_that_changes_the_shared_data_has_it_put_back_and_copies_copy_it_from_then_on(capsys):
    model, twin, x = CountsInConfig(), CountsInConfig(), torch.randn(2, 4)
    sizes = model.config.sizes
    with private(Target("m", model, (x,))) as subject, torch.no_grad():
        subject.model(*subject.args)
        assert subject.model.config is model.config and model.config.calls == 1
    assert vars(model.config) == vars(twin.config) and model.config.sizes is sizes
    assert weights.shared_data(model) == []
    with private(Target("m", model, (x,))) as subject, torch.no_grad():
        assert subject.model.config is not model.config
    # Mended and called twice, the config holds the user's two calls, no more.
    report = graphmend.mend(model, x)
    assert report.verified and not hasattr(model.config, "calls")
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(x), twin(x))
    assert vars(model.config) == vars(twin.config) and model.config.calls == 2
    capsys.readouterr()


def test_plain_data_past_the_walks_limit_is_copied_as_before():
    model = CopiesConfig()
    model.vocabulary = list(range(weights._DATA_LIMIT))
    data = weights._Data.of(model)
    twin = copy_of(model, share=True, data=data)
    assert twin.config is model.config  # walked first, within the limit
    assert twin.vocabulary is not model.vocabulary and twin.vocabulary == model.vocabulary


def test_data_that_refers_back_to_itself_is_copied_as_before():
    model = CopiesConfig()
    model.config.parent = model.config
    twin = copy_of(model, share=True, data=weights._Data.of(model))
    assert twin.config is not model.config and twin.config.parent is twin.config
