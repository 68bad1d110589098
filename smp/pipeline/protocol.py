"""The messages pipeline stages exchange (design.md §4): their kinds and header layouts.

A message is a header (ints, its kind first) and tensors, sent by ``smp.pipeline.sender.Sender``
over ``smp._C.Transport``:

- REQUEST ``[REQUEST, mb, call id, module index, mode, flags, n refs, (slot, stage, call id,
  slot) per ref, stream key, quiet digest (quiet calls only)]``, with the arguments' skeleton and
  the tensors not sent as references. Module index ``_FETCH``: a FETCH (:func:`_fetch_header`) of
  an earlier call's outputs or of an argument the caller kept.
- REPLY ``[REPLY, mb, call id, called no other stage]``, with the outputs' skeleton and, unless
  they are fetched when used, the outputs; a FETCH's REPLY ``[REPLY, mb, fetch id]``.
- GRAD_OUT ``[GRAD_OUT, mb, call id, output slots..., -1 - slot for each gradient of ones]``,
  with the gradients of a call's outputs (caller → owner).
- GRAD_IN ``[GRAD_IN, mb, call id, input slots...]``, with the gradients of a call's inputs
  (owner → caller); without gradients it says that the call's backward is done.
- ERROR ``[ERROR]``, with the failing stage's error text.
- STEP_END ``[STEP_END]``: the sender's step is over (the leader's: ``[STEP_END, backward
  calls]``).
"""

REQUEST, REPLY, GRAD_OUT, GRAD_IN, ERROR, STEP_END = range(1, 7)
_QUIET = 2  # a REQUEST's flag (header[5], beside "push"): Note [Quiet calls]
_FETCH = -1  # the module index of a REQUEST that asks for an earlier call's outputs
_ARGUMENT = -2  # a FETCH's caller: it asks for an argument of the receiver's own call


def _fetch_header(mb: int, fetch_id: int, grad: bool, caller: int, call_id: int, slot: int):
    """A FETCH: outputs of the call ``call_id`` that the receiver served for ``caller`` (-1: the
    sender), all of them (``slot`` -1) or one; ``grad``: its gradient will come back. With
    ``caller`` :data:`_ARGUMENT`: request slot ``slot`` of the call ``call_id`` that the receiver
    made, which it kept (Note [Arguments fetched when read], smp.pipeline.calls)."""
    return [REQUEST, mb, fetch_id, _FETCH, int(grad), 1, 1, 0, caller, call_id, slot]


# Note [Quiet calls]
# A call of the step function that returns futures at once (its output structure predicted), whose
# outputs stay on the owner (not pushed), whose arguments need no gradient back or got none back
# from the last answered call with the same key (the next layer of a chain on one stage: its input
# is the last layer's output, held there, and an HF cache holds other layers' keys and values,
# which it does not read) and whose module's last answered call called no other stage (a flag of
# the REPLY) is *quiet*: the owner sends neither REPLY nor GRAD_IN for it, the caller waits for
# neither, and only the REQUEST and the caller's GRAD_OUT travel. The REQUEST carries the digest
# of the structure the caller continued with. Otherwise a REPLY says what an asynchronous call's
# owner knows once its forward has run: the structure (checked against the prediction) and that
# nothing else happened; a GRAD_IN without gradients only says that its backward is done. On the
# HF Llama of benchmarks/pipeline_hf_llama.py 7 of the 9 calls of a microbatch are quiet (layers 6
# and 7, the norm, the head, three of the loss's four ops on the logits): 22 messages instead of
# 36, and the leader's backward waits once, not thrice.
# - The owner answers a quiet call only when it went otherwise: outputs of another structure (a
#   REPLY with the skeleton), gradients for its arguments (a GRAD_IN), or a call to another stage
#   (an empty REPLY, before that call is sent: the caller may be at the end of its step, no longer
#   serving). The caller then raises CallStructureChanged, wherever it is in the step (its loop or
#   _await_stage_ends), and the step runs again (smp.step) with that module's calls answered
#   (``loud``). So a quiet call never calls another stage: its backward sends nothing back either.
# - Nobody waits for its end, so the stage serving it does not leave the step while it has one
#   whose forward is not done, or whose backward its caller has begun (GRAD_OUT arrived) and is
#   not done (PipelineServer.hold_open). What such a call waits for is on its way: its inputs, its
#   consumers' gradients, from the caller (its GRAD_OUTs precede its STEP_END) or from this or a
#   third stage (each stage finishes its calls before it leaves).
# - The leader's microbatch may finish before a quiet call's backward; the schedule only sees its
#   microbatches' end earlier, the step's end still waits for every stage's STEP_END.
# Not from a served call (whose REPLY must mean that every call it made is done) nor with TP (no
# predictions there).
