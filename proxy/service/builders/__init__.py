"""Response builders: the driver's events in one API's wire format.

One module per API surface. A builder is two functions of the ``Prepared``
request: one turns a ``Completion`` into the JSON body of a non-streaming
response, one turns the event stream into the bytes of a streaming one
(``Delta`` -> a chunk, ``Finish`` -> the choice's last chunk, ``Done`` ->
usage and the end marker, ``Failed`` -> the API's error event and the end
marker). Builders hold no state beyond one response and never touch the
store or the backends.
"""
