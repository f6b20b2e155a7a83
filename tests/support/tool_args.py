"""The Python tool's flags for runs on the tests' warm start, whose answers read "a+b=c,c-d=e.\\boxed{e}": markers it
writes, so its answers make calls without a model trained to write python blocks (the default markers)."""

# Each boxed answer is a call (the answer's digits run as code): needs room for the whole answer (~40 tokens).
BOXED_AS_CALLS = ["--data.tool.max_calls", "2", "--data.tool.code_start", "\\boxed{", "--data.tool.code_end", "}",
                  "--data.tool.sandbox.workers", "2", "--data.tool.timeout_s", "2"]  # fmt: skip
# The first result ("=c,") is a call, within the first 8 tokens, whose output ("c" and a newline) the answer goes on
# after: calls in 16-token answers, and in the first segment of partial rollouts.
FIRST_RESULT_AS_CALL = ["--data.tool.max_calls", "2", "--data.tool.code_start", "=", "--data.tool.code_end", ",",
                        "--data.tool.output_start", "", "--data.tool.output_end", "\\n", "--data.tool.sandbox.workers",
                        "2", "--data.tool.timeout_s", "2"]  # fmt: skip
