"""Mixed precision that is safe to reach for, and summary.json's record of the machine.

* ``amp=bf16`` is refused in one line on a CPU without native bfloat16 (faked: ``fedhpro.runtime.cpu_features``
  monkeypatched) and accepted on one with it; under ``privacy=sample`` only what the user asked for is refused.
* ``channels_last=auto`` (the default): a convolutional model trains in channels_last under ``amp=bf16`` (the
  batches its convolution sees, its weights), an MLP does not, and the float32 default trains in the contiguous
  format, bit for bit as ``channels_last=false``.
* On a GPU without native bfloat16 training falls back to float16 autocast with a gradient scaler: the
  choice with ``torch.cuda.is_bf16_supported`` mocked, the scaler path run on the CPU (no GPU result faked).
* summary.json's ``machine`` block; ``fedhpro run``'s start-up note (printed, not in summary.json's notes).
* The no-grad passes (features in a client's fit, the evaluation) run under training's autocast with amp=bf16,
  handing back float32 close to float32's, on the simulator and on Flower's ClientApp alike; with amp=off they
  are bit for bit the old passes. Where amp=bf16 is refused (no native bfloat16) nothing runs in it
  (``test_bf16_is_refused_in_one_line_on_a_cpu_without_native_bf16``).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import DIGITS_SYN_SIZE, DIGITS_TEST_FRACTION, NUM_CLASSES, TinyBNNet, TinyNet, make_client
from torch import nn

from fedhpro import cli, runtime
from fedhpro.config import channels_last_setting, load_config
from fedhpro.errors import ConfigError
from fedhpro.experiment import check_precision
from fedhpro.methods import TrainSettings
from fedhpro.methods import no_grad as no_grad_module
from fedhpro.methods import training as training_module
from fedhpro.methods.training import train_epochs
from fedhpro.runtime import CpuFeatures

#: an AVX2-only CPU (an older AMD EPYC) and one with AMX and AVX512-BF16 (a Sapphire Rapids Xeon)
AVX2_ONLY = CpuFeatures("AMD EPYC 7B12", avx2=True, avx512=False, avx512_bf16=False, amx=False, capability="AVX2")
AMX = CpuFeatures("Intel(R) Xeon(R) Platinum 8480+", avx2=True, avx512=True, avx512_bf16=True, amx=True,
                  capability="AVX512")
CPU = torch.device("cpu")


@pytest.fixture
def fake_cpu(monkeypatch):
    """``fake_cpu(features)``: every caller of ``fedhpro.runtime.cpu_features`` sees ``features``."""
    def use(features: CpuFeatures) -> None:
        monkeypatch.setattr(runtime, "cpu_features", lambda: features)
    return use


def tiny_run(data_dir: Path, out: Path, *extra: str) -> list[str]:
    """``fedhpro run`` arguments of a one-round run on 3 clients of ~40 digits (d=16, one epoch, one thread)."""
    return ["run", "method=fedavg", "rounds=1", "clients=3", "data.fraction=0.02", f"data.syn_size={DIGITS_SYN_SIZE}",
            f"data.test_fraction={DIGITS_TEST_FRACTION}", "feature_dim=16", "local_epochs=1", "progress=false",
            "threads=1", "device=cpu", f"data_dir={data_dir}", f"out={out}", *extra]


# ---------------------------------------------------------------------------- the hardware check


def test_bf16_is_refused_in_one_line_on_a_cpu_without_native_bf16(fake_cpu, digits_data_dir, tmp_path, capsys):
    fake_cpu(AVX2_ONLY)
    assert cli.main(tiny_run(digits_data_dir, tmp_path / "run", "amp=bf16")) == 2
    printed = capsys.readouterr()
    lines = printed.err.strip().splitlines()
    assert len(lines) == 1, printed.err
    line = lines[0]
    assert line.startswith("fedhpro: error: amp=bf16 refused: this CPU (AMD EPYC 7B12 (AVX2)) has no native bfloat16")
    assert f"about {runtime.EMULATED_BF16_SLOWDOWN}x slower than float32" in line  # the measured slowdown
    assert line.endswith("use amp=off")  # the fix
    assert not (tmp_path / "run" / "summary.json").exists()


def test_bf16_is_accepted_on_a_cpu_with_native_bf16(fake_cpu):
    fake_cpu(AMX)
    assert runtime.precision_problem("bf16", CPU) is None
    check_precision(load_config(None, ["amp=bf16"]), CPU)  # no error
    fake_cpu(AVX2_ONLY)
    assert runtime.precision_problem("off", CPU) is None  # float32 runs anywhere
    assert runtime.precision_problem("bf16", torch.device("cuda")) is None  # a GPU is not judged by the CPU
    with pytest.raises(ConfigError, match="use amp=off$"):
        check_precision(load_config(None, ["amp=bf16"]), CPU)


def test_cpu_features_are_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R)  Processor\n"
                    "flags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile amx_bf16\n\n"
                    "processor\t: 1\nmodel name\t: other\nflags\t\t: fpu\n")
    model, flags = runtime._cpuinfo(str(info))
    assert model == "Intel(R) Xeon(R) Processor"
    assert flags is not None and {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"} <= flags
    assert runtime._cpuinfo(str(tmp_path / "missing")) == (None, None)
    assert AMX.native_bf16 and not AVX2_ONLY.native_bf16
    assert CpuFeatures("x", avx2=True, avx512=True, avx512_bf16=False, amx=True).native_bf16  # AMX alone
    assert AMX.isa() == {"avx2": True, "avx512": True, "avx512_bf16": True, "amx": True}


def test_privacy_sample_refuses_only_what_the_user_asked_for(fake_cpu):
    fake_cpu(AMX)
    private = ["privacy=sample", "model=cnn"]
    check_precision(load_config(None, private), CPU)  # amp=off and channels_last=auto: nothing asked, no refusal
    for asked in ("amp=bf16", "channels_last=true"):
        with pytest.raises(ConfigError) as refused:
            check_precision(load_config(None, [*private, asked]), CPU)
        message = str(refused.value)
        assert "\n" not in message and message.startswith("privacy=sample trains in eager float32")
        assert "amp=off" in message and "channels_last=false" in message


# ---------------------------------------------------------------------------- channels_last=auto


def memory_formats_seen(model: nn.Module, data, train: TrainSettings) -> tuple[set[bool], nn.Module]:
    """Whether each batch the model's first layer saw was channels_last (a set of booleans), and the model."""
    trained = copy.deepcopy(model)
    seen: set[bool] = set()
    first = trained.features[0]
    first.register_forward_pre_hook(lambda module, args: seen.add(
        args[0].dim() == 4 and args[0].is_contiguous(memory_format=torch.channels_last)
        and not args[0].is_contiguous()))
    train_epochs(trained, data, train, torch.Generator().manual_seed(0))
    return seen, trained


def test_bf16_trains_a_conv_model_in_channels_last():
    torch.manual_seed(0)
    seen, trained = memory_formats_seen(TinyBNNet(), make_client(24, list(range(NUM_CLASSES)), seed=1),
                                        TrainSettings(batch_size=8, amp="bf16"))
    assert seen == {True}
    conv = trained.features[0].weight
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
    assert all(p.dtype == torch.float32 for p in trained.parameters())  # the weights stay float32


def test_bf16_leaves_an_mlp_contiguous():
    torch.manual_seed(0)
    data = make_client(24, list(range(NUM_CLASSES)), seed=1)
    assert data.x.dim() == 4  # images: channels_last would apply to the batches if it were on
    seen, _ = memory_formats_seen(TinyNet(), data, TrainSettings(batch_size=8, amp="bf16"))
    assert seen == {False}
    assert not runtime.trains_channels_last(None, "bf16", TinyNet())
    # an explicit channels_last=true still converts an MLP's image batches
    seen, _ = memory_formats_seen(TinyNet(), data, TrainSettings(batch_size=8, amp="bf16", channels_last=True))
    assert seen == {True}


def test_the_float32_default_is_contiguous_and_unchanged(monkeypatch):
    options = load_config(None).run
    assert (options.amp, options.channels_last) == ("off", "auto")
    assert channels_last_setting(options.channels_last) is None
    assert TrainSettings().channels_last is None and not TrainSettings().fast_path
    torch.manual_seed(0)
    model = TinyBNNet()
    data = make_client(24, list(range(NUM_CLASSES)), seed=2)
    explicit_off, _ = memory_formats_seen(model, data, TrainSettings(batch_size=8, channels_last=False))
    # the default path never enters the fast path's forward (exactly the operations it had before)
    monkeypatch.setattr(training_module, "_fast_forward", lambda *args: pytest.fail("the default ran the fast path"))
    seen, default = memory_formats_seen(model, data, TrainSettings(batch_size=8))
    assert seen == explicit_off == {False}
    assert default.features[0].weight.is_contiguous()
    torch.manual_seed(0)
    reference = copy.deepcopy(model)
    train_epochs(reference, data, TrainSettings(batch_size=8, channels_last=False), torch.Generator().manual_seed(0))
    assert all(torch.equal(a, b) for a, b in zip(default.state_dict().values(), reference.state_dict().values()))


def test_auto_falls_back_to_contiguous_for_a_model_that_views_its_activations():
    class Viewing(nn.Module):  # a user's model: .view() needs NCHW strides
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)
            self.classifier = nn.Linear(4 * 8 * 8, NUM_CLASSES)

        def features(self, x):
            y = self.conv(x)
            return y.view(y.shape[0], -1)

    torch.manual_seed(0)
    model = Viewing()
    data = make_client(24, list(range(NUM_CLASSES)), seed=1)
    losses = train_epochs(model, data, TrainSettings(batch_size=8, amp="bf16"), torch.Generator().manual_seed(0))
    assert losses["loss"] == losses["loss"]  # trained (finite), in the contiguous format
    assert model.conv.weight.is_contiguous()
    with pytest.raises(RuntimeError):  # asked for explicitly: the error is the user's to see
        train_epochs(Viewing(), data, TrainSettings(batch_size=8, amp="bf16", channels_last=True),
                     torch.Generator().manual_seed(0))


# ---------------------------------------------------------------------------- GPUs: bf16 or fp16 + scaler


def test_a_gpu_without_native_bf16_gets_fp16_with_a_scaler(monkeypatch):
    monkeypatch.setattr(runtime, "cuda_bf16_native", lambda device: False)
    assert runtime.amp_precision("bf16", torch.device("cuda")) == "fp16"
    assert runtime.amp_precision("off", torch.device("cuda")) == "float32"
    monkeypatch.setattr(runtime, "cuda_bf16_native", lambda device: True)
    assert runtime.amp_precision("bf16", torch.device("cuda:0")) == "bf16"
    assert runtime.amp_precision("bf16", CPU) == "bf16"


def test_cuda_bf16_native_asks_torch_without_emulation(monkeypatch):
    asked = []

    def is_bf16_supported(including_emulation=True):
        asked.append(including_emulation)
        return False

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
    monkeypatch.setattr(torch.cuda, "device", lambda device: __import__("contextlib").nullcontext())
    assert runtime.cuda_bf16_native(torch.device("cuda")) is False
    assert asked == [False]


def test_the_fp16_path_scales_the_loss_and_keeps_float32_weights(monkeypatch):
    """The float16 fallback's code path, run on the CPU (CPU autocast takes float16 too): a GradScaler scales
    each loss and steps the optimiser; the update stays close to float32's and the weights float32."""
    scalers: list = []
    real = torch.amp.GradScaler

    class Recording(real):  # type: ignore[misc, valid-type]
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.steps = 0
            scalers.append(self)

        def step(self, optimizer, *args, **kwargs):
            self.steps += 1
            return super().step(optimizer, *args, **kwargs)

    monkeypatch.setattr(torch.amp, "GradScaler", Recording)
    monkeypatch.setattr(runtime, "amp_precision", lambda amp, device: "fp16" if amp != "off" else "float32")
    dtypes: list[torch.dtype] = []
    torch.manual_seed(0)
    model = TinyBNNet()
    model.classifier.register_forward_hook(lambda module, args, output: dtypes.append(output.dtype))
    data = make_client(32, list(range(NUM_CLASSES)), seed=4)
    reference = copy.deepcopy(model)
    train_epochs(reference, data, TrainSettings(epochs=2, batch_size=8), torch.Generator().manual_seed(0))
    dtypes.clear()
    fast = copy.deepcopy(model)
    train_epochs(fast, data, TrainSettings(epochs=2, batch_size=8, amp="bf16", max_grad_norm=5.0),
                 torch.Generator().manual_seed(0))
    assert len(scalers) == 1 and scalers[0].steps == 8  # 2 epochs x 4 batches, each through the scaler
    assert set(dtypes) == {torch.float16}
    assert all(p.dtype == torch.float32 for p in fast.parameters())
    expected = torch.cat([(a - b).flatten() for a, b in zip(reference.parameters(), model.parameters())])
    got = torch.cat([(a - b).flatten() for a, b in zip(fast.parameters(), model.parameters())])
    assert float(F.cosine_similarity(expected.detach(), got.detach(), dim=0)) > 0.95


# ---------------------------------------------------------------------------- summary.json and the start-up note


@pytest.mark.slow
def test_summary_records_the_machine(fake_cpu, digits_data_dir, tmp_path, capsys):
    fake_cpu(AMX)
    assert cli.main(tiny_run(digits_data_dir, tmp_path / "bf16", "amp=bf16")) == 0
    machine = json.loads((tmp_path / "bf16" / "summary.json").read_text())["machine"]
    assert list(machine) == ["cpu", "isa", "gpu", "threads", "parallel_clients", "client_threads", "precision",
                             "memory_format"]
    assert machine == {"cpu": AMX.model, "isa": AMX.isa(), "gpu": None, "threads": 1, "parallel_clients": 1,
                       "client_threads": 1, "precision": "bf16",
                       "memory_format": "channels_last"}  # the default cnn: channels_last=auto is on
    server = torch.load(tmp_path / "bf16" / "server_state.pt", weights_only=True)["server"]["weights"]
    assert all(value.dtype == torch.float32 for value in server.values() if value.is_floating_point())
    assert cli.main(tiny_run(digits_data_dir, tmp_path / "mlp", "amp=bf16", "model=mlp")) == 0
    machine = json.loads((tmp_path / "mlp" / "summary.json").read_text())["machine"]
    assert (machine["precision"], machine["memory_format"]) == ("bf16", "contiguous")
    assert cli.main(tiny_run(digits_data_dir, tmp_path / "fp32")) == 0
    machine = json.loads((tmp_path / "fp32" / "summary.json").read_text())["machine"]
    assert (machine["precision"], machine["memory_format"]) == ("float32", "contiguous")


@pytest.mark.slow
def test_the_start_up_note_is_printed_and_not_kept(fake_cpu, digits_data_dir, tmp_path, capsys):
    fake_cpu(AMX)
    assert cli.main(tiny_run(digits_data_dir, tmp_path / "note")) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if "native bfloat16" in line]
    assert notes == [f"note: {runtime.bf16_note('off', CPU)}"]
    assert notes[0].startswith("note: this CPU has native bfloat16 (Intel(R) Xeon(R) Platinum 8480+ (AMX, "
                               "AVX512-BF16)): amp=bf16 trains")
    kept = json.loads((tmp_path / "note" / "summary.json").read_text())["notes"]
    assert not any("bfloat16" in note for note in kept)
    # amp on, or a CPU without native bfloat16: no note
    assert cli.main(tiny_run(digits_data_dir, tmp_path / "amp", "amp=bf16")) == 0
    assert "native bfloat16" not in capsys.readouterr().out
    fake_cpu(AVX2_ONLY)
    assert cli.main(tiny_run(digits_data_dir, tmp_path / "avx2")) == 0
    assert "native bfloat16" not in capsys.readouterr().out


# ---------------------------------------------------------------------------- the no-grad passes' precision

#: bfloat16 keeps 8 significant bits (relative rounding 2^-9 per operation); TinyBNNet's features (tanh, in
#: [-1, 1]) after a convolution and a linear layer of a few hundred inputs: measured within 0.004 of float32's
BF16_FEATURE_TOLERANCE = 0.02


def autocast_seen(monkeypatch) -> list[tuple[bool, bool, torch.dtype]]:
    """Every no-grad forward of :func:`fedhpro.methods.no_grad.eval_forward` (features, evaluation), as
    ``(grad enabled, autocast on the CPU, dtype handed back)``, whichever engine called it."""
    seen: list[tuple[bool, bool, torch.dtype]] = []
    original = no_grad_module.eval_forward

    def spy(module, batch):
        output = original(module, batch)
        seen.append((torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"), output.dtype))
        return output

    monkeypatch.setattr(no_grad_module, "eval_forward", spy)
    return seen


def test_bf16_no_grad_passes_run_under_autocast_and_return_float32_close_to_float32(monkeypatch):
    from fedhpro.engines.one_round import count_correct

    torch.manual_seed(0)
    model = TinyBNNet().eval()
    data = make_client(150, list(range(NUM_CLASSES)), seed=3)
    float32 = no_grad_module.extract_features(model, data.x)
    float32_correct = count_correct(model, data.x, data.y)
    seen = autocast_seen(monkeypatch)
    with no_grad_module.no_grad_precision("bf16", CPU):
        bf16 = no_grad_module.extract_features(model, data.x)
        bf16_correct = count_correct(model, data.x, data.y)
    assert seen and all(not grad and autocast and dtype == torch.float32 for grad, autocast, dtype in seen)
    assert bf16.dtype == torch.float32 and bf16.shape == float32.shape
    assert not torch.equal(bf16, float32)  # bfloat16 did compute them
    assert float((bf16 - float32).abs().max()) <= BF16_FEATURE_TOLERANCE
    assert abs(bf16_correct - float32_correct) <= 0.05 * len(data)
    seen.clear()
    assert torch.equal(no_grad_module.extract_features(model, data.x), float32)  # outside the block: float32 again
    assert seen == [(False, False, torch.float32)] * len(seen)


def test_amp_off_no_grad_passes_equal_the_old_code(monkeypatch):
    """amp=off: the features and the counts are bit for bit what the passes computed before (by hand here:
    eval mode, batches of 64 in channels_last, float32), inside the block and outside it."""
    from fedhpro.engines.one_round import count_correct, test_client

    torch.manual_seed(0)
    model = TinyBNNet()
    data = make_client(150, list(range(NUM_CLASSES)), seed=4)
    model.eval()
    with torch.no_grad():
        batches = [data.x[i:i + 64].contiguous(memory_format=torch.channels_last) for i in range(0, 150, 64)]
        features = torch.cat([model.features(batch) for batch in batches])
        correct = sum(int((model(batch).argmax(1) == data.y[i * 64:(i + 1) * 64]).sum())
                      for i, batch in enumerate(batches))
    model.train()
    seen = autocast_seen(monkeypatch)
    with no_grad_module.no_grad_precision("off", CPU):
        assert torch.equal(no_grad_module.extract_features(model, data.x), features)
        assert count_correct(model, data.x, data.y) == correct
    assert torch.equal(no_grad_module.extract_features(model, data.x), features)

    class Plain:  # a server whose inference rule is the model itself
        def inference_model(self, model):
            return model

    assert test_client(Plain(), model, "t", (data.x, data.y), amp="off").correct == correct
    assert seen and all(not autocast for _, autocast, _ in seen)


@pytest.mark.slow
@pytest.mark.parametrize("amp", ["off", "bf16"])
def test_both_engines_run_their_no_grad_passes_in_the_runs_precision(fake_cpu, monkeypatch, digits_data_dir,
                                                                     tmp_path, amp):
    """FedHPro's feature passes inside a client's fit and the evaluation, on the simulator and on Flower's
    ClientApp handlers (run in-process): under autocast exactly when amp=bf16, float32 results either way."""
    pytest.importorskip("flwr", reason="the Flower engine needs the flower extra")
    from flwr.app import Context, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from fedhpro import api
    from fedhpro.flower import client as client_app
    from fedhpro.flower.engine import build_server_side
    from fedhpro.flower.strategy import MethodStrategy

    fake_cpu(AMX)  # amp=bf16 is accepted whatever this CPU is; autocast runs (emulated where not native)
    settings = {"method": "fedhpro", "rounds": 1, "clients": 2, "data.fraction": 0.02,
                "data.syn_size": DIGITS_SYN_SIZE, "data.test_fraction": DIGITS_TEST_FRACTION, "feature_dim": 16,
                "local_epochs": 1, "device": "cpu", "data_dir": str(digits_data_dir), "progress": False,
                "threads": 1, "amp": amp}
    seen = autocast_seen(monkeypatch)
    api.run(settings, out=str(tmp_path / "simulator"))
    simulator_seen = list(seen)

    seen.clear()
    monkeypatch.setattr(TaskIdentity, "_run_id", 1)  # outside a run, flwr refuses to address a Message
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)
    config = load_config(settings)
    strategy = MethodStrategy(build_server_side(config), config, {0: 10, 1: 11})
    contexts = {node: Context(run_id=1, node_id=node, node_config={"partition-id": k, "num-partitions": 2},
                              state=RecordDict(), run_config={}) for k, node in ((0, 10), (1, 11))}

    class Grid:  # the SuperLink, answered by the real ClientApp handlers in this process
        def get_node_ids(self):
            return list(contexts)

        def send_and_receive(self, messages, timeout=None):
            replies = []
            for number, message in enumerate(messages):
                message.metadata.__dict__["_message_id"] = f"m{number}"
                handler = client_app.evaluate if message.metadata.message_type == "evaluate" else client_app.train
                replies.append(handler(message, contexts[message.metadata.dst_node_id]))
            return replies

    grid = Grid()
    strategy.aggregate_train(1, grid.send_and_receive(list(strategy.configure_train(1, None, None, grid))))
    strategy.aggregate_evaluate(1, grid.send_and_receive(list(strategy.configure_evaluate(1, None, None, grid))))
    assert "accuracy" in strategy.rows[-1]
    flower_seen = list(seen)
    for passes in (simulator_seen, flower_seen):
        assert len(passes) >= 4  # features in each client's fit, then the evaluation
        assert all(not grad and autocast == (amp == "bf16") and dtype == torch.float32
                   for grad, autocast, dtype in passes)
