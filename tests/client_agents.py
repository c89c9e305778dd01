"""One tool-using, two-question conversation per client library, each written the way
that library's own documentation writes it, with its default settings (no max_tokens,
its own message shapes and serialisation). Run in the `clients` role environment:

    python tests/client_agents.py LIBRARY      # openai | openai-agents | langchain |
                                               # pydantic-ai | litellm

The endpoint and key come from OPENAI_BASE_URL and OPENAI_API_KEY (a gateway run's).
Prints one JSON line: {"library", "answers": [two final texts], "tool_calls": [cities]}.
"""

import asyncio
import json
import os
import sys

MODEL = "gyre-policy"
SYSTEM = "You answer questions about the weather. Use the get_weather tool."
QUESTIONS = ["What is the weather in Paris?", "And in Rome?"]
CALLED: list[str] = []


def get_weather(city: str) -> str:
    """Get the current weather of a city."""
    CALLED.append(city)
    return f"sunny, 21 C in {city}"


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def with_openai() -> list[str]:
    from openai import OpenAI

    client = OpenAI()
    messages, answers = [{"role": "system", "content": SYSTEM}], []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        while True:
            reply = client.chat.completions.create(model=MODEL, messages=messages,
                                                   tools=[WEATHER_TOOL])
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                answers.append(message.content)
                break
            for call in message.tool_calls:
                args = json.loads(call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": get_weather(**args)})
    return answers


def with_agents() -> list[str]:
    from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool
    from agents import set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # no trace upload (there is no network here)

    async def main():
        agent = Agent(name="weather", instructions=SYSTEM, tools=[function_tool(get_weather)],
                      model=OpenAIChatCompletionsModel(model=MODEL, openai_client=AsyncOpenAI()))
        first = await Runner.run(agent, QUESTIONS[0])
        second = await Runner.run(agent, first.to_input_list()
                                  + [{"role": "user", "content": QUESTIONS[1]}])
        return [first.final_output, second.final_output]
    return asyncio.run(main())


def with_langchain() -> list[str]:
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    weather = tool(get_weather)
    llm = ChatOpenAI(model=MODEL, base_url=os.environ["OPENAI_BASE_URL"]).bind_tools([weather])
    messages, answers = [SystemMessage(SYSTEM)], []
    for question in QUESTIONS:
        messages.append(HumanMessage(question))
        while True:
            reply = llm.invoke(messages)
            messages.append(reply)
            if not reply.tool_calls:
                answers.append(reply.content)
                break
            for call in reply.tool_calls:
                messages.append(ToolMessage(weather.invoke(call["args"]),
                                            tool_call_id=call["id"]))
    return answers


def with_pydantic_ai() -> list[str]:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(
        base_url=os.environ["OPENAI_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"]))
    agent = Agent(model, system_prompt=SYSTEM, tools=[get_weather])
    first = agent.run_sync(QUESTIONS[0])
    second = agent.run_sync(QUESTIONS[1], message_history=first.all_messages())
    return [first.output, second.output]


def with_litellm() -> list[str]:
    import litellm

    kw = dict(model=f"openai/{MODEL}", api_base=os.environ["OPENAI_BASE_URL"],
              api_key=os.environ["OPENAI_API_KEY"])
    messages, answers = [{"role": "system", "content": SYSTEM}], []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        while True:
            reply = litellm.completion(messages=messages, tools=[WEATHER_TOOL], **kw)
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                answers.append(message.content)
                break
            for call in message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": get_weather(**json.loads(call.function.arguments))})
    return answers


LIBRARIES = {"openai": with_openai, "openai-agents": with_agents, "langchain": with_langchain,
             "pydantic-ai": with_pydantic_ai, "litellm": with_litellm}

if __name__ == "__main__":
    library = sys.argv[1]
    answers = LIBRARIES[library]()
    print(json.dumps({"library": library, "answers": answers, "tool_calls": CALLED}))
