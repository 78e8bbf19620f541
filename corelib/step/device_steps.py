"""The device side of one step, the same in process and in a worker: stage, run, hand off."""

from __future__ import annotations

import torch

from corelib.step.handoff import StepHandle, StepResult, TokenHandoff
from corelib.step.runner import ModelRunner
from corelib.step.staging import InputStager, Staged
from corelib.support.faults import maybe_fail


class DeviceSteps:
    """Submits staged steps to the device and reads their results back, in submission order."""

    def __init__(self, runner: ModelRunner, stager: InputStager, handoff: TokenHandoff) -> None:
        self.runner = runner
        self.stager = stager
        self.handoff = handoff

    def submit(self, staged: Staged) -> StepHandle:
        """Queue one step on the device; returns at once with a handle on its tokens."""
        maybe_fail("submit")
        fi = staged.fi
        self.runner.prepare(fi)  # a missing graph is captured before the inputs are staged
        buffer, timing = self.handoff.begin(fi.step_id)
        target = self.runner.input_target()
        arena = self.stager.to_device(staged, target)
        prompt = self.handoff.prompt_buffers(fi.prompt_logprobs) if fi.prompt_logprobs else None
        graph = self.runner.run(fi, arena, None if prompt is None else prompt.device)
        handle = StepHandle(fi.step_id, fi.kind, fi.num_seqs, buffer, None, timing, graph, (staged, target),
                            on_done=staged.release, logprobs=fi.logprobs, prompt=prompt)
        if not fi.mask_deferred:
            self._emit(handle)
        return handle

    def supply_mask(self, handle: StepHandle, masks: torch.Tensor | None) -> None:
        """Queue the sampling of a step queued before its grammar mask (``ForwardInput.mask_deferred``), through
        ``masks`` (host memory of the step's arena; None: every token allowed), then its tokens' handoff."""
        if handle.event is not None:
            raise RuntimeError(f"step {handle.step_id}: its mask was supplied already, or never owed")
        self.runner.sample_owed(masks)
        self._emit(handle)

    def _emit(self, handle: StepHandle) -> None:
        """After the step's sampling is queued: the stager's bookkeeping, and its tokens on their way to the host."""
        self.stager.after_forward()
        handle.event = self.handoff.emit(handle.buffer, handle.num_seqs, handle.timing, handle.logprobs,
                                         handle.prompt)

    def wait(self, handle: StepHandle, timeout: float | None = None, *, spin: bool = True) -> None:
        """Until a step's tokens are in host memory (bounded); reads nothing, so any thread may wait.
        ``spin=False``: asleep from the start (another thread spins on the step's event)."""
        if handle.tokens is None:
            handle.ready_event().synchronize(timeout, spin=spin)

    def result(self, handle: StepHandle, timeout: float | None = None) -> StepResult:
        """Wait for a step's tokens (bounded) and give its inputs back."""
        return self.handoff.read(handle, timeout)

    def close(self) -> None:
        try:
            self.runner.close()
        finally:
            self.stager.close()
