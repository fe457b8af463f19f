"""Agent frameworks against a running Engram server: LangChain's `bind_tools` and
`with_structured_output`, and litellm with `tools`. Not needed by the package; install them apart:

    python -m venv /tmp/agents && /tmp/agents/bin/pip install langchain-openai litellm
    engram serve --tool-call-parser hermes --enable-auto-tool-choice &      # the embedded model
    /tmp/agents/bin/python scripts/agent_frameworks.py --base-url http://127.0.0.1:30000/v1

With the embedded random model the words are noise, but forced tool choices and schemas are held
by the grammar, so every call and every structured answer must parse; the script exits 1 if not.
"""

from __future__ import annotations

import argparse
import json
import sys

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The forecast for a city.", "parameters": WEATHER}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]


def langchain_checks(base_url: str, model: str) -> None:
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Forecast(BaseModel):
        city: str = Field(pattern="^(Paris|Rome)$")
        days: int = Field(ge=1, le=7)

    llm = ChatOpenAI(base_url=base_url, api_key="unused", model=model, temperature=0, max_tokens=120, max_retries=0)
    for choice in ("get_weather", "required"):
        message = llm.bind_tools([TOOL], tool_choice=choice, parallel_tool_calls=False).invoke(QUESTION)
        assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather", message
        print(f"langchain bind_tools(tool_choice={choice!r}):", message.tool_calls)
    for method in ("json_schema", "function_calling"):
        answer = llm.with_structured_output(Forecast, method=method).invoke(QUESTION)
        assert isinstance(answer, Forecast), answer
        print(f"langchain with_structured_output(method={method!r}):", answer)


def litellm_checks(base_url: str, model: str) -> None:
    import litellm

    kw = dict(
        model=f"openai/{model}",
        api_base=base_url,
        api_key="unused",
        messages=QUESTION,
        tools=[TOOL],
        temperature=0,
        max_tokens=120,
        parallel_tool_calls=False,
    )  # one call: a random model's list of calls may outrun max_tokens
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = litellm.completion(tool_choice=choice, **kw)
        calls = r.choices[0].message.tool_calls
        assert calls and calls[0].function.name == "get_weather", r
        print(f"litellm tools (tool_choice={choice!r}):", [(c.id, c.function.name, json.loads(c.function.arguments)) for c in calls])
    arguments: dict[int, str] = {}
    for chunk in litellm.completion(tool_choice="required", stream=True, **kw):
        for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            arguments[call.index] = arguments.get(call.index, "") + (call.function.arguments or "")
    assert list(arguments) == [0], arguments
    print("litellm streamed arguments:", json.loads(arguments[0]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:30000/v1")
    parser.add_argument("--model", default=None, help="served model name (default: the server's only model)")
    args = parser.parse_args()
    import httpx

    model = args.model or httpx.get(args.base_url.rstrip("/") + "/models").json()["data"][0]["id"]
    failed = False
    for check in (langchain_checks, litellm_checks):
        try:
            check(args.base_url, model)
        except Exception as e:  # report every framework, then fail
            print(f"{check.__name__} FAILED: {type(e).__name__}: {e}", file=sys.stderr)
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
