"""`efficient.check(model, example)`: the bugs that silently corrupt a spiking model's accuracy and firing
statistics, each found by running the model and reported PASS / FAIL / SKIP with its number.

    report = efficient.check(model, example)           # a module and a batch of real inputs
    report = efficient.check("spikformer-tiny", pretrained=True)   # a zoo name, or a run dir
    print(report); report.passed; report["batch"].value

Spiking layers are found as the profiler finds them: our neurons, spikingjelly's `BaseNode` and
snntorch's `SpikingNeuron` (the outermost one where neurons nest). A layer's *input* is the first
positional argument of its call, its *spikes* the tensor it returns (the first one of a tuple, as
snntorch's `(spk, mem)`). Multi-step layers see `[T, B, ...]` in one call; single-step layers are
called once per step, so call k is step k. Checks (ids in brackets):

- batch independence [batch]: the output of a sample must not depend on the rest of its batch. The
  first and last samples are kept, every other sample is replaced by random values, and every
  spiking layer's input gets random values at those other samples too. FAIL when the kept samples'
  model output, or their input or spikes at any spiking layer, moves by more than `rtol` relative
  to its scale. Run in eval and in train mode; in train mode BatchNorm normalises with its running
  statistics (batch statistics couple samples by design) and dropout draws the same masks.
  The first spiking layer whose kept samples change while its input did not is named: a neuron fed
  `[T*B, ...]` leaks membrane from one sample into the next (QKFormer issue 14).
- state reset between calls [state]: a call must not see what earlier calls left behind. The same
  batch runs, after one call on it, a second time, and a third time after a call on other inputs
  (with random currents at every spiking layer); FAIL when either differs from the first by more
  than `rtol`. Between calls the check runs only `reset(model)` (default: nothing), so a
  spikingjelly model without `functional.reset_net` or an snntorch model with hidden state fails
  unless that reset is passed. Eval mode.
- time causality [causality]: what a model computes at step t must not depend on inputs after t.
  Every spiking layer's input (and the model input, if it is time-major) gets random values at the
  steps after t0 = (T - 1) // 2; FAIL when any spiking layer's input or spikes at steps <= t0, or a
  time-major model output there, moves by more than `rtol`. SKIP without time steps (T < 2) or when
  nothing after t0 moved either (nothing reached). Eval mode (BatchNorm in training mixes steps).
- silent / saturated layers [rates]: per spiking layer, the firing rate on the example (nonzero
  spikes / spike entries, over all calls and steps, eval mode). FAIL when a layer's rate is at most
  `silent_rate` (default 0: it never fired) or at least `saturated_rate` (default 0.99). Only on real
  data: SKIP when no example was given (random inputs say nothing about a trained model's rates).
- dead surrogate gradients [surrogate]: in train mode, per spiking layer, the gradient its own
  backward passes (the vector-Jacobian product of its spikes with random upstream gradients, taken
  w.r.t. its input) and the gradient of a random projection of the model output reaching its input.
  FAIL when either is all zero (or absent) for a layer: a neuron without a surrogate, or one whose
  surrogate is zero everywhere it is evaluated, or a cut gradient path.
- binary spikes [binary]: a spiking layer's spikes are what the op after it reads, and that op is
  meant to be spike-driven (its cost counted as accumulates). FAIL when any layer's spikes hold a
  value other than exactly 0 or 1 (graded or scaled spikes, a membrane leaking into the output, a
  surrogate in non-spiking mode). Eval mode, on the example; exact, as spikes are exact.

Relative differences are `max |a - b| / max |a|` over the compared entries, the scale taken over
the whole tensor (1 where it is all zero): nothing depends on the last bits of one CPU. The model is
left as it was: modes, parameters, buffers, and peers' neuron state reset to rest.
"""

from efficient.checks.api import CHECK_BATCH, RTOL, SATURATED_RATE, SILENT_RATE, check
from efficient.checks.passes import spiking_layers
from efficient.checks.report import CHECKS, CheckReport, CheckResult, LayerFinding, Status

__all__ = ["CHECKS", "CHECK_BATCH", "RTOL", "SATURATED_RATE", "SILENT_RATE", "CheckReport", "CheckResult", "LayerFinding",
           "Status", "check", "spiking_layers"]
