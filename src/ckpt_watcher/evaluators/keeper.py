"""Keep one loaded engine across a warm worker's jobs: swap each new checkpoint's weights into
it when nothing else changed, and prove on a probe set that the swapped engine equals a fresh
load.

A swap is tried only when the new checkpoint has the same *signature* as the loaded one: its
`config.json` (apart from fields that do not change the graph), its tokenizer and generation
files, and the engine's arguments. Anything else, or any error in a swap, loads cold; the job
loses nothing.

An engine may also be started before its first checkpoint's weights exist (`prepare`): from a
folder holding only the model's config and tokenizer, on placeholder (random) weights (not for a
model whose buffers still hold placeholder values after loading, a quantized KV cache's scales
say: the check below does not see buffers). Its weights are then set to NaN, and the first
checkpoint of that signature is served only once `fill_check` proved its swap: the checkpoint
with its hidden dimension permuted swapped in and probed, then its own weights, with no NaN
left in any parameter (a weight the swap left out, or one the checkpoint lacks, still holds
it) and the same probes (a layer that kept what it derived from the placeholder at load, the
tied head vLLM's reload leaves, gives other tokens one way than the other; so does a linear
layer's weight on vLLM's CPU backend, which packs them outside the parameters at load, where
no NaN reaches them and only the probes see what a swap left out). Only its two swaps
and two probes come after the weights are written: the scramble (and a first probe's own
set-up) is done before, and with no cold load there is nothing to swap back to. Anything else
loads cold. A placeholder is never evaluated: a request of another signature, or an adapter,
drops it.

An engine serving LoRA adapters (`req.lora`) holds their base, loaded with LoRA enabled (on
hf: peft attaches each adapter, peft_adapter.py): it is kept while the next adapter's base is the
same folder with no file written since (on hf, its modules and tensors as loaded), and never
swapped into (only the adapter changes, harness.py); any other base loads cold.

Swaps are checked, two ways:
- the *quick check*, once per signature, on the engine a cold load just made (its checkpoint's
  files are held for its job): every weight set to NaN, the checkpoint's weights with the hidden
  dimension permuted swapped in (the same function, weights.py), the probes compared with the
  cold load's; then the checkpoint's own weights swapped back, every parameter's bits and the
  probes equal to the cold load's. A swap that leaves a weight out, or a layer deriving from its
  weights only at load (vLLM's tied head), fails it. It costs two swaps and a few probes, not an
  engine start; where it does not apply (tensor names it does not know) or fails, the first swap
  is checked against a fresh load instead;
- against a fresh load: greedy tokens and their logprobs on `PROBE_TEXTS` from the swapped
  engine against a fresh load of the same checkpoint (which then serves the job), for the first
  swap of a signature the quick check did not prove, and then every `verify_every`-th swap. A
  mismatch sends that signature cold for good.
Imported only inside worker processes.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from ckpt_watcher.checkpoints.files import LocalFiles, eval_mark
from ckpt_watcher.errors import SwapError
from ckpt_watcher.evaluators import engine_watch, heap, peft_adapter, vllm_internals, weights
from ckpt_watcher.evaluators.harness import Engine, engine_args, load_model
from ckpt_watcher.evaluators.signature import model_signature
from ckpt_watcher.jobfolder import EvalRequest

log = structlog.get_logger("ckpt_watcher.evaluators.keeper")

# A few prompts of prose, code and arithmetic; greedy continuation of PROBE_TOKENS tokens each.
PROBE_TEXTS = (
    "The capital of France is",
    "Question: Natalia sold clips to 48 of her friends. How many clips did she sell?\nAnswer:",
    "def fibonacci(n):\n    ",
    "12+34=",
    "7+8=",
    "Once upon a time",
    "The derivative of x^2 is",
    "1, 2, 3, 5, 8,",
)
PROBE_TOKENS = 8


# --- probes: greedy tokens and their logprobs ----------------------------------------------
Probe = list[tuple[list[int], list[float]]]


def probe(lm: Any, backend: str) -> Probe:
    if backend == "vllm":
        return vllm_internals.probe(lm, _probe_ids(lm), PROBE_TOKENS)
    return _probe_hf(lm)


def _probe_ids(lm: Any) -> list[list[int]]:
    """The probe texts as token ids, each cut to leave room for PROBE_TOKENS in the context."""
    room = max(1, int(lm.max_length) - PROBE_TOKENS)
    out = []
    for text in PROBE_TEXTS:
        ids = list(lm.tokenizer(text, add_special_tokens=False).input_ids)[:room]
        if ids:
            out.append(ids)
    return out


def _probe_hf(lm: Any) -> Probe:
    import torch

    model, tok = lm.model, lm.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    out = []
    with torch.no_grad():
        for prompt in _probe_ids(lm):
            ids = torch.tensor([prompt], device=model.device)
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=PROBE_TOKENS,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=pad,
            )
            tokens = gen.sequences[0, ids.shape[1] :].tolist()
            logprobs = [
                torch.log_softmax(score[0].float(), dim=-1)[t].item()
                for score, t in zip(gen.scores, tokens, strict=False)
            ]
            out.append((tokens, logprobs))
    return out


TIE_LOGPROB = math.log(0.5)  # two tokens tying for the top are each at most this likely


def tolerance(dtype: str | None) -> tuple[float, float]:
    """(atol, rtol) for a logprob. Swapped and fresh engines hold the same weights and run the
    same kernels on the same batch, so on CPU their numbers are equal to the bit, except where
    the weights sit at other memory alignments (an hf model filled from a placeholder: its
    step-by-step logprobs differ in the last bits); on GPU the reduction order may differ. A
    float32 engine then moves logprobs by ~1e-6; a 16-bit one (8 to 11 mantissa bits, eps 2^-8
    for bfloat16) by up to ~1% of a logprob. A stale or half
    swapped weight moves them by far more and usually changes the greedy tokens."""
    if str(dtype).replace("torch.", "") in ("float32", "float", "fp32"):
        return 1e-4, 1e-4
    return 1e-3, 1e-2


def hidden_size(checkpoint: Path) -> int | None:
    """The model's hidden size from its config (None where it names none)."""
    try:
        config = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    value = config.get("hidden_size")
    return value if isinstance(value, int) else None


@dataclass
class Reach:
    """How the quick check reaches a loaded model: an engine in this process, or a model
    server over HTTP (harnesses/server.py)."""

    probe: Callable[[], Probe]
    digest: Callable[[], dict[str, int]]
    scramble: Callable[[], object]
    swap: Callable[[], object]  # the checkpoint's own weights
    swap_permuted: Callable[[], object]  # its weights with the hidden dimension permuted
    # the parameters holding a NaN (an engine started on placeholder weights, scrambled)
    unwritten: Callable[[], list[str]] | None = None


def quick_check(reach: Reach, dtype: str | None) -> tuple[str | None, bool, dict[str, float]]:
    """The quick check (module docstring) of a model a cold load just made: None when it
    holds, else why not; whether the model holds the cold load's weights again (every
    parameter's bits and the probes as loaded, checked whatever the permuted swap gave); and
    the seconds it took."""
    began = time.monotonic()
    cold, bits = reach.probe(), reach.digest()
    reach.scramble()
    reach.swap_permuted()
    permuted = compare(reach.probe(), cold, dtype)
    swapped = time.monotonic()
    reach.swap()
    back = weights.compare_digests(reach.digest(), bits) or compare(reach.probe(), cold, dtype)
    why = f"with the hidden dimension permuted: {permuted}" if permuted else back
    ended = time.monotonic()
    return (
        why,
        back is None,
        {"permuted_s": round(swapped - began, 3), "back_s": round(ended - swapped, 3)},
    )


def fill_check(reach: Reach, dtype: str | None) -> tuple[str | None, dict[str, float]]:
    """The check of the first weights swapped into an engine started on placeholder weights
    that `prepare` scrambled (module docstring): None when it holds, else why not; and the
    seconds it took. The checkpoint's weights with the hidden dimension permuted swapped in and
    probed, then its own weights: every parameter written (no NaN left) and the same probes.
    The engine then holds the checkpoint's weights, whatever the verdict."""
    assert reach.unwritten is not None
    began = time.monotonic()
    reach.swap_permuted()
    permuted = reach.probe()
    swapped = time.monotonic()
    reach.swap()
    left = reach.unwritten()
    why = (
        f"{len(left)} parameter(s) left at the placeholder (or NaN in the checkpoint), "
        f"e.g. {left[0]}"
        if left
        else None
    )
    if why is None:
        differ = compare(permuted, reach.probe(), dtype)
        why = f"with the hidden dimension permuted: {differ}" if differ else None
    ended = time.monotonic()
    return why, {"permuted_s": round(swapped - began, 3), "back_s": round(ended - swapped, 3)}


def compare(warm: Probe, cold: Probe, dtype: str | None) -> str | None:
    """None when the probes agree; else the first difference, in words. Tokens must be equal
    and each logprob within `tolerance`, but for a near tie: where the two greedy choices part,
    each chosen with the same logprob (within the tolerance) and neither likelier than 1/2,
    two tokens tie for the top in both, and the rest of that probe (another text) is not
    compared. Sums in another order (a permuted hidden dimension, a GPU's reductions) break
    such a tie either way; a stale or missing weight moves the logprobs far more."""
    atol, rtol = tolerance(dtype)

    def near(a: float, b: float) -> bool:
        return abs(a - b) <= atol + rtol * abs(b)

    if len(warm) != len(cold):
        return f"{len(warm)} probe outputs against {len(cold)}"
    for i, ((wt, wl), (ct, cl)) in enumerate(zip(warm, cold, strict=True)):
        at = _parting(wt, ct)  # len(wt) where they are the same
        tie = (
            at < min(len(wt), len(ct))
            and near(wl[at], cl[at])
            and max(wl[at], cl[at]) <= TIE_LOGPROB + atol
        )
        if wt != ct and not tie:
            return f"probe {i}: greedy token {at} differs ({wt} against a fresh load's {ct})"
        for j in range(at):
            if not near(wl[j], cl[j]):
                return (
                    f"probe {i}: token {j}'s logprob {wl[j]:.6f} against a fresh load's {cl[j]:.6f}"
                )
    return None


def _parting(a: list[int], b: list[int]) -> int:
    """Where two token lists first differ (the shorter one's length if one begins the other)."""
    return next(
        (j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


# --- swapping --------------------------------------------------------------------------------
def swap(lm: Any, backend: str, checkpoint: str) -> None:
    if backend == "vllm":
        vllm_internals.swap(lm, checkpoint)
    else:
        _swap_hf(lm.model, Path(checkpoint))


def engine_reach(lm: Any, backend: str, checkpoint: str, hidden: int) -> Reach:
    """The quick check's way to an engine in this process (vLLM's `LLM`, or an hf model)."""
    if backend == "vllm":
        rpc = lm.model.collective_rpc

        def swap_permuted() -> None:
            rpc("ckpt_watcher_swap_permuted", args=(checkpoint, str(hidden)))
            lm.model.reset_prefix_cache()

        return Reach(
            probe=lambda: probe(lm, backend),
            digest=lambda: rpc("ckpt_watcher_digest")[0],
            scramble=lambda: rpc("ckpt_watcher_scramble"),
            swap=lambda: swap(lm, backend, checkpoint),
            swap_permuted=swap_permuted,
            unwritten=lambda: sorted({n for names in rpc("ckpt_watcher_unwritten") for n in names}),
        )
    return Reach(
        probe=lambda: probe(lm, backend),
        digest=lambda: weights.digest(lm.model),
        scramble=lambda: weights.scramble(lm.model),
        swap=lambda: swap(lm, backend, checkpoint),
        swap_permuted=lambda: _load_hf(
            lm.model, dict(weights.permuted(Path(checkpoint), hidden)), checkpoint
        ),
        unwritten=lambda: weights.unwritten(lm.model),
    )


def _swap_hf(model: Any, checkpoint: Path) -> None:
    from safetensors.torch import load_file

    state: dict[str, Any] = {}
    for f in weights.weight_files(checkpoint):
        state.update(load_file(f))
    _load_hf(model, state, checkpoint)


def _load_hf(model: Any, state: dict[str, Any], checkpoint: Path | str) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    # a tied parameter's other names (a tied head's `lm_head.weight`): where the checkpoint
    # also has the first name, its tensor is what a cold load keeps (`from_pretrained` ties the
    # head to the embeddings after loading), so the alias's is not written over it
    first = {id(p): name for name, p in model.named_parameters()}
    state = {
        k: v
        for k, v in state.items()
        if k not in params or first[id(params[k])] == k or first[id(params[k])] not in state
    }
    loaded = {id(params[k]) for k in state if k in params}
    missing, unexpected = model.load_state_dict(state, strict=False)
    untied = [k for k in missing if k not in params or id(params[k]) not in loaded]
    if unexpected or untied:
        raise SwapError(
            f"{checkpoint}: weights do not match the loaded model "
            f"(missing {untied[:3]}, unexpected {list(unexpected)[:3]})"
        )
    model.eval()


def shutdown(lm: Any) -> None:
    """Stop vLLM's engine, if `lm` has one (hf models have none)."""
    engine_watch.stop(lm)  # its engine process ends now, on purpose
    try:
        vllm_internals.shutdown(lm)
    except Exception as e:  # a broken engine: the process group dies with the worker anyway
        log.warning("engine.shutdown_failed", error=f"{type(e).__name__}: {e}")


def free_memory() -> None:
    """Collect what no longer has a reference (then freeze what is left, see heap.py), and
    hand cached GPU memory back."""
    heap.settle()
    import torch

    if torch.cuda.is_available():
        try:
            torch.cuda.empty_cache()
        except RuntimeError as e:  # a broken CUDA context: the next load says more
            log.warning("engine.empty_cache_failed", error=str(e))


def _signature(req: EvalRequest) -> str:
    """The signature of `req`'s checkpoint with the engine arguments a kept engine has."""
    _, args = engine_args(req, swappable=True)
    if req.lora is not None and req.backend != "vllm":  # an hf base that serves adapters
        args["ckpt_watcher_peft"] = True  # (vLLM's says so: enable_lora) takes no swap
    return model_signature(Path(req.checkpoint), req.backend, args)


# --- the keeper ------------------------------------------------------------------------------
@dataclass
class EngineKeeper:
    """The worker's one engine, across its jobs."""

    verify_every: int = 20
    lm: Any = None
    signature: str | None = None
    checkpoint: str | None = None
    base_mark: Any = None  # the write mark of the base an adapter engine loaded
    placeholder: bool = False  # holds placeholder weights (prepare): never evaluated as is
    early_base: bool = False  # holds a LoRA run's base, loaded before its first adapter came
    no_placeholder: dict[str, str] = field(default_factory=dict)  # signature -> why not
    swaps: dict[str, int] = field(default_factory=dict)  # swaps per signature
    cold_for_good: dict[str, str] = field(default_factory=dict)  # signature -> why
    checked: set[str] = field(default_factory=set)  # signatures the quick check proved here
    events: list[dict[str, Any]] = field(default_factory=list)  # for engine.json / status

    @property
    def ahead(self) -> bool:
        """It holds an engine started before its run's first checkpoint (prepare)."""
        return self.placeholder or self.early_base

    def acquire(self, req: EvalRequest) -> Engine:
        """The engine for `req`'s checkpoint: swapped into the kept one when possible."""
        began = time.monotonic()
        sig = _signature(req)
        if self.placeholder:  # an engine started before its weights: filled, or dropped
            if req.lora is None and sig == self.signature and sig not in self.cold_for_good:
                engine = self._fill(req, sig, began)
                if engine is not None:
                    return engine
            self.drop()
        if req.lora is not None:  # an adapter served on its base: the base is kept, or loaded
            return self._base_for_adapter(req, sig, began)
        if self.lm is not None and sig == self.signature and sig not in self.cold_for_good:
            n = self.swaps.get(sig, 0)
            try:
                swap(self.lm, req.backend, req.checkpoint)
                self.swaps[sig] = n + 1
                self.checkpoint = req.checkpoint
                if self.fresh_check_due(sig, n):
                    return self._verify(req, sig, began)
            except Exception as e:  # any error in or after a swap: a cold start, nothing lost
                self.event("engine.swap_failed", error=f"{type(e).__name__}: {e}")
            else:
                log.info("engine.swapped", checkpoint=req.checkpoint, swaps=n + 1)
                return Engine(self.lm, "warm", time.monotonic() - began)
        self.drop()
        self._load(req, sig)
        hidden = self.quick_check_due(sig, Path(req.checkpoint))
        if hidden is not None:
            reach = engine_reach(self.lm, req.backend, req.checkpoint, hidden)
            if not self.quick_verdict("engine", req, sig, reach):
                self.drop()  # what the check left loaded is not the checkpoint's weights
                self._load(req, sig)
        return Engine(self.lm, "cold", time.monotonic() - began)

    def _base_for_adapter(self, req: EvalRequest, sig: str, began: float) -> Engine:
        """The engine for an adapter served on its base (`req.checkpoint`): the kept one while
        it holds that base as it was loaded (the same folder, no file of it written since),
        else a cold load. Its weights are never swapped: only the adapter changes, and each
        is loaded under an id of its own (vllm_internals.use_adapter)."""
        mark = eval_mark(LocalFiles(Path(req.checkpoint), follow_links=True))
        if (
            self.lm is not None
            and sig == self.signature
            and req.checkpoint == self.checkpoint
            and mark == self.base_mark
            and peft_adapter.intact(self.lm)
        ):
            log.info("engine.base_kept", base=req.checkpoint, adapter=req.lora)
            kind, self.early_base = ("early" if self.early_base else "warm"), False
            return Engine(self.lm, kind, time.monotonic() - began)
        self.drop()
        self._load(req, sig)
        self.base_mark = mark
        return Engine(self.lm, "cold", time.monotonic() - began)

    def _load(self, req: EvalRequest, sig: str) -> None:
        self.lm = load_model(req, swappable=True)
        self.signature, self.checkpoint = sig, req.checkpoint

    def prepare(self, req: EvalRequest) -> str:
        """Start an engine for `req` (its checkpoint: a folder with the model's config and
        tokenizer, no weights needed) on placeholder weights, for the first checkpoint of that
        signature to be swapped into (`acquire`); returns the signature. With `req.lora` (a
        LoRA run on vLLM) its base is loaded for real instead, with LoRA enabled, and kept for
        that adapter's job (`_base_for_adapter`)."""
        sig = _signature(req)
        if req.lora is not None:  # a LoRA run: its base, for real, with LoRA enabled
            self.drop()
            self._load(req, sig)
            self.base_mark = eval_mark(LocalFiles(Path(req.checkpoint), follow_links=True))
            self.early_base = True
            return sig
        if sig in self.cold_for_good:
            raise SwapError(f"swaps are off for this architecture: {self.cold_for_good[sig]}")
        if sig in self.no_placeholder:
            raise SwapError(self.no_placeholder[sig])
        self.drop()
        try:
            self.lm = load_model(req, swappable=True, placeholder=True)
        except SwapError as e:  # a model no placeholder stands for (PlaceholderHF): cold
            self.no_placeholder[sig] = str(e)
            raise
        # (hf: buffers are computed from the config, as cold; one the checkpoint must set and
        # lacks fails the swap, _load_hf)
        why = self._random_buffers() if req.backend == "vllm" else ""
        if why:  # what no swap is proven to set: its first checkpoint loads cold
            self.drop()
            self.no_placeholder[sig] = why
            raise SwapError(why)
        why = self._scramble(req.backend)
        if why:  # (maybe a passing fault, an allocation say: the next step may start one)
            self.drop()
            raise SwapError(why)
        self.signature, self.checkpoint, self.placeholder = sig, None, True
        return sig

    def _scramble(self, backend: str) -> str:
        """Probe the engine just started on placeholder weights once (a first probe's own
        set-up, 0.05 s on the tests' model, is then not paid after the weights are written),
        then set every weight to NaN, so that the check of the first weights (`fill_check`)
        sees any a swap leaves out; or why it could not be done."""
        step = "probed"
        try:
            probe(self.lm, backend)
            step = "scrambled"
            if backend == "vllm":
                self.lm.model.collective_rpc("ckpt_watcher_scramble")
            else:
                weights.scramble(self.lm.model)
        except Exception as e:  # an engine whose first weights cannot be proven: cold
            return f"its placeholder weights could not be {step}: {type(e).__name__}: {e}"
        return ""

    def _random_buffers(self) -> str:
        """Why the vLLM engine just started on placeholder weights cannot be filled by a swap
        (buffers still at placeholder values, in any of its workers), or ""."""
        try:  # every worker's (each holds a part of the model under TP or PP)
            per_worker = self.lm.model.collective_rpc("ckpt_watcher_random_buffers")
        except Exception as e:  # what cannot be checked is not started ahead
            return f"its buffers could not be checked: {type(e).__name__}: {e}"
        random = sorted({name for names in per_worker for name in names})
        return f"buffers a placeholder sets at random: {random[:3]}" if random else ""

    def _fill(self, req: EvalRequest, sig: str, began: float) -> Engine | None:
        """The first checkpoint swapped into an engine `prepare` started (and scrambled): its
        Engine once `fill_check` proved the swap wrote every weight, else None (the caller
        loads cold)."""
        self.placeholder = False
        hidden = hidden_size(Path(req.checkpoint))
        try:
            known = hidden is not None and weights.permutable(Path(req.checkpoint), hidden)
        except Exception:  # unreadable headers: the cold load says so
            known = False
        if not known:  # nothing proves the swap wrote every weight: a cold load serves it
            self.event("engine.fill_unproven", checkpoint=req.checkpoint, signature=sig)
            return None
        assert hidden is not None
        reach = engine_reach(self.lm, req.backend, req.checkpoint, hidden)
        try:
            why, seconds = fill_check(reach, req.model_args.get("dtype"))
        except Exception as e:  # a cold load says more, if the checkpoint itself is at fault
            self.event("engine.fill_failed", error=f"{type(e).__name__}: {e}")
            return None
        self.checkpoint = req.checkpoint
        fields = {"checkpoint": req.checkpoint, "signature": sig, "check": "quick", **seconds}
        if why is not None:
            self.event("engine.quick_check_failed", reason=why, **fields)
            return None
        self.checked.add(sig)
        self.event("engine.verify_ok", **fields)
        log.info("engine.filled", checkpoint=req.checkpoint, signature=sig)
        return Engine(self.lm, "early", time.monotonic() - began)

    def fresh_check_due(self, sig: str, n: int) -> bool:
        """The swap after `n` swaps of `sig` is checked against a fresh load: the first, unless
        the quick check proved the signature, then every `verify_every`-th."""
        return n % self.verify_every == 0 and not (n == 0 and sig in self.checked)

    def quick_check_due(self, sig: str, checkpoint: Path) -> int | None:
        """The hidden size to permute when a cold load of `sig` is to be quick-checked: never
        swapped here or on this device before, not cold for good, tensors the check knows."""
        if sig in self.checked or sig in self.cold_for_good or self.swaps.get(sig, 0):
            return None
        hidden = hidden_size(checkpoint)
        try:
            known = hidden is not None and weights.permutable(checkpoint, hidden)
        except Exception as e:  # unreadable headers: the cold load would have said so
            log.warning("engine.quick_check_skipped", error=f"{type(e).__name__}: {e}")
            return None
        return hidden if known else None

    def quick_verdict(self, what: str, req: EvalRequest, sig: str, reach: Reach) -> bool:
        """Run the quick check on a model a cold load made: `<what>.verify_ok` and the
        signature proved, or `<what>.quick_check_failed` (its first swap is then checked
        against a fresh load). False: the model no longer holds the cold load's weights, and
        the caller loads the checkpoint again (a check that failed only with the dimension
        permuted, bfloat16's sums in another order say, leaves the model as loaded)."""
        try:
            why, restored, seconds = quick_check(reach, req.model_args.get("dtype"))
        except Exception as e:  # an engine that cannot do it: a fresh load checks the swap
            why, restored, seconds = f"{type(e).__name__}: {e}", False, {}
        fields = {"checkpoint": req.checkpoint, "signature": sig, "check": "quick", **seconds}
        if why is None:
            self.checked.add(sig)
            self.event(f"{what}.verify_ok", **fields)
        else:
            self.event(f"{what}.quick_check_failed", reason=why, **fields)
        return restored

    def _verify(self, req: EvalRequest, sig: str, began: float) -> Engine:
        """Probe the swapped engine, load the checkpoint fresh, probe again, compare. The fresh
        engine serves the job either way (it is the one whose results are right)."""
        swapped = time.monotonic()
        warm = probe(self.lm, req.backend)
        probed = time.monotonic()
        self.drop()
        dropped = time.monotonic()
        self._load(req, sig)
        loaded = time.monotonic()
        cold = probe(self.lm, req.backend)
        seconds = {
            "swap_s": round(swapped - began, 3),
            "probe_s": round(probed - swapped, 3),
            "release_s": round(dropped - probed, 3),
            "load_s": round(loaded - dropped, 3),
        }
        self.judge("engine", req, sig, warm, cold, seconds)
        return Engine(self.lm, "cold", time.monotonic() - began)

    def judge(
        self,
        what: str,
        req: EvalRequest,
        sig: str,
        warm: Probe,
        cold: Probe,
        seconds: dict[str, float],
    ) -> None:
        """The check's verdict on a swap into `what` (an engine, or a model server): the
        `<what>.verify_ok` event, or `<what>.verify_failed` and the signature cold for good."""
        why = compare(warm, cold, req.model_args.get("dtype"))
        fields = {"checkpoint": req.checkpoint, "signature": sig, "check": "fresh", **seconds}
        if why is None:
            self.event(f"{what}.verify_ok", **fields)
        else:
            self.cold_for_good[sig] = why
            self.event(f"{what}.verify_failed", reason=why, **fields)

    def drop(self, exiting: bool = False) -> None:
        """Release the engine. `exiting`: the process ends next and its memory with it, so the
        engine is only shut down (on CUDA its core process ends cleanly), not collected."""
        if self.lm is not None:
            shutdown(self.lm)
            self.lm = None  # the last reference: the model can be collected now
            if not exiting:
                free_memory()
        self.signature = self.checkpoint = self.base_mark = None
        self.placeholder = self.early_base = False

    def event(self, event: str, **fields: Any) -> None:
        (log.info if event.endswith("verify_ok") else log.warning)(event, **fields)
        self.events = (self.events + [{"event": event, "at": time.time(), **fields}])[-20:]
