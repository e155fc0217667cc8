"""The request fields of vLLM's OpenAI-compatible server, as its protocol source declares them.

Read from vllm-project/vllm at commit d5dba2d7b0ab9b98096560c69db7126b54b14d79:
  vllm/entrypoints/openai/chat_completion/protocol.py   class ChatCompletionRequest
  vllm/entrypoints/openai/completion/protocol.py        class CompletionRequest
(the split of the former vllm/entrypoints/openai/protocol.py), in declaration order. The
``guided_*`` names are the structured-output fields of earlier releases (replaced by
``structured_outputs``) that clients still send. ``tests/frontend/test_http_options.py`` sends
every one of them and checks that NInfer honours it or refuses it with a 400 naming it.
"""

CHAT_FIELDS = [
    # OpenAI's fields, in the order of OpenAI's documentation
    "messages", "model", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "max_tokens",
    "max_completion_tokens", "n", "presence_penalty", "response_format", "seed", "stop", "stream",
    "stream_options", "temperature", "top_p", "tools", "tool_choice", "reasoning_effort", "include_reasoning",
    "parallel_tool_calls", "user",
    # chat-completion-sampling-params
    "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
    "spaces_between_special_tokens", "truncate_prompt_tokens", "prompt_logprobs", "allowed_token_ids",
    "bad_words",
    # chat-completion-extra-params
    "echo", "add_generation_prompt", "continue_final_message", "add_special_tokens", "documents",
    "chat_template", "chat_template_kwargs", "mm_processor_kwargs", "structured_outputs", "priority",
    "request_id", "logits_processors", "return_tokens_as_token_ids", "return_token_ids", "cache_salt",
    "kv_transfer_params", "vllm_xargs", "max_repetition_pattern_size", "min_repetition_pattern_size",
    "repetition_min_count",
]

COMPLETION_FIELDS = [
    "model", "prompt", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
    "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature", "top_p", "user",
    # completion-sampling-params
    "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
    "spaces_between_special_tokens", "truncate_prompt_tokens", "allowed_token_ids", "prompt_logprobs",
    # completion-extra-params
    "prompt_embeds", "add_special_tokens", "response_format", "structured_outputs", "priority", "request_id",
    "logits_processors", "return_tokens_as_token_ids", "return_token_ids", "cache_salt", "kv_transfer_params",
    "vllm_xargs", "max_repetition_pattern_size", "min_repetition_pattern_size", "repetition_min_count",
]

# vLLM's StreamOptions (vllm/entrypoints/openai/engine/protocol.py)
STREAM_OPTIONS = ["include_usage", "continuous_usage_stats"]

# the structured-output names of earlier vLLM releases, on both endpoints
LEGACY_GUIDED = ["guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
                 "guided_whitespace_pattern"]
