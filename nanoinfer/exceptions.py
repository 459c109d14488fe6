"""The error of a bad request: a ValueError that names the parameter at fault.

Raised wherever a request is validated (SamplingParams, GuidedDecodingParams, InputProcessor), so
that a caller learns which parameter was wrong from `parameter`, not from the message's words: the
server's error body takes its `param` from it (by the name the request gave that field).
"""
import functools


class ValidationError(ValueError):

    def __init__(self, message: str, *, parameter: str):
        super().__init__(message)
        # A SamplingParams field ("temperature", "guided_decoding", ...), or "prompt", "messages",
        # "request_id", "sampling_params".
        self.parameter = parameter

    def __reduce__(self):
        # (as pickle and copy rebuild it: BaseException's own passes `args` alone)
        return functools.partial(ValidationError, parameter=self.parameter), (str(self),)
