"""`efficient.check(model, example)`: the bugs that silently corrupt a spiking model's accuracy and
firing statistics, each found by running the model and reported PASS / FAIL / SKIP with its number.

    report = efficient.check(model, example)           # a module and a batch of real inputs
    report = efficient.check("spikformer-tiny", pretrained=True)   # a zoo name, or a run dir
    print(report); report.passed; report["batch"].value

Spiking layers are found as the profiler finds them: our neurons, spikingjelly's `BaseNode` and
snntorch's `SpikingNeuron` (the outermost one where neurons nest). A layer's *input* is the first
positional argument of its call, its *spikes* the tensor it returns (the first one of a tuple, as
snntorch's `(spk, mem)`). Multi-step layers see `[T, B, ...]` in one call; single-step layers are
called once per step, so call k is step k.

The batch, state and causality checks compare two passes of a small check batch (the example's
first 3 samples, 4 when T is 3). In both passes every spiking layer's input gets the same *drive*: a normal random
current of spread 3 that depends only on the layer, the call and the seed, so layers fire whatever
the weights (an untrained or silent layer would hide a leaked membrane); one pass then changes what
the check varies. A change is the relative difference `max |a - b| / max |a|` (the scale over the
whole tensor of the first pass, 1 where it is all zero); FAIL above `rtol` (1e-4). A sound model
changes by exactly 0 (the same arithmetic on the same values), a bug by O(1), so nothing depends on
the last bits of one CPU. Checks (ids in brackets) and their numbers:

- batch independence [batch]: a sample's output must not depend on the rest of its batch. The
  first and last samples are kept; those between are replaced by random values, at the model input
  and at every spiking layer's input. Number: the largest change of the kept samples' model output, or of their input or
  spikes at any spiking layer. Eval and train mode; in train mode BatchNorm normalises with its
  running statistics (batch statistics couple samples by design) and dropout draws the same masks.
  The first spiking layer whose kept samples change while its input did not is named: a neuron fed
  `[T*B, ...]` leaks membrane from one sample into the next (QKFormer issue 14).
- state reset between calls [state]: a call must not see what earlier calls left behind. The batch
  runs again right after a first call, and once more after a call on other inputs; number: the
  largest change from the first call (output, spiking layers' inputs and spikes). Between calls
  only `reset(model)` runs (default: nothing), so a spikingjelly model without
  `functional.reset_net` or an snntorch model with hidden state fails unless that reset is passed.
  Eval mode. When it fails, the other checks start each pass with one call on the same input, so
  the leftover state is the same in both passes they compare.
- time causality [causality]: what a model computes at step t must not depend on inputs after t.
  Every spiking layer's input (and the model input, if it is time-major) gets random values at the
  steps after t0 = (T - 1) // 2; number: the largest change at steps <= t0 of any spiking layer's
  input or spikes, or of a time-major model output `[T, B, ...]`. SKIP without time (T unknown or 1).
  Eval mode (BatchNorm in training mixes steps). Ops that mix time steps by design end what is
  judged: a STATA token selection (one token set for every step, chosen from every step's scores)
  or a module with `mixes_time = True`; a change before the first of them FAILs, one only after it
  gives SKIP, saying where judging stopped.
- silent / saturated layers [rates]: per spiking layer, the firing rate on the example itself (no
  drive; nonzero spikes / spike entries over all calls and steps; eval mode). FAIL when a layer's
  rate is at most `silent_rate` (default 0: it never fired) or at least `saturated_rate` (default
  0.99); number: how many. Only on real data: SKIP on random inputs (no example given).
- dead surrogate gradients [surrogate]: per spiking layer, in train mode on the check batch, (a) the
  gradient its own backward passes: the vector-Jacobian product of its spikes with random upstream
  gradients w.r.t. its input, on its real input and alone on a sweep of currents in [-2r, 4r]
  (r = its input's spread, at least 1); (b) the gradient of a random projection of the model output
  reaching its input. FAIL when a layer passes no gradient for any current of the sweep (no
  surrogate, or one that is zero) or no autograd path reaches its input (a detach); on real data
  also when (a) or (b) is all zero on it (its inputs never fall in the surrogate's window, or dead
  layers after it block everything). Number: how many layers fail.
- binary spikes [binary]: a spiking layer's spikes are what the op after it reads, and that op is
  meant to be spike-driven (its cost counted as accumulates, SOPs). FAIL when any layer's spikes hold
  a value other than exactly 0 or 1 (graded or scaled spikes, a membrane leaking into the output, a
  surrogate in non-spiking mode); number: the largest fraction of such entries in a layer. On the
  example, eval mode, no drive; exact, as spikes are exact.

The model is left as it was: modes, parameters, buffers (train passes put back the BatchNorm
statistics they move), the global RNG, and peers' neuron state at rest. On CPU our neurons with
backend "auto" run their eager reference meanwhile (the same spikes, without a compile per shape).
"""

from efficient.checks.api import CHECK_BATCH, RTOL, SATURATED_RATE, SILENT_RATE, check
from efficient.checks.passes import spiking_layers
from efficient.checks.report import CHECKS, CheckReport, CheckResult, LayerFinding, Status

__all__ = ["CHECKS", "CHECK_BATCH", "RTOL", "SATURATED_RATE", "SILENT_RATE", "CheckReport", "CheckResult", "LayerFinding",
           "Status", "check", "spiking_layers"]
