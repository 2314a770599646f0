"""--tool-server: the Responses API runs MCP tools itself. A real MCP server (the mcp
package's FastMCP, SSE transport) on loopback; a scripted scheduler whose first answer
calls the server's `add` tool (hermes format) and whose second answers in text. The
tool's result must reach the second prompt, and the response lists the call."""

from __future__ import annotations

import socket
import threading
import time

import grpc
import httpx
import pytest
import uvicorn
from app_server import AppServer
from gateway_harness import MAX_MODEL_LEN

from pagoda.services._proto.pagoda.common.v1 import common_pb2 as cpb
from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2 as spb
from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2_grpc as spb_grpc
from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2_grpc as tpb_grpc
from pagoda.services.gateway.app import create_app
from pagoda.services.gateway.openai.responses_api.mcp_turn import MAX_ROUNDS
from pagoda.services.gateway.serving_options import ServingOptions
from pagoda.services.tokenizer.servicer import TokenizerServicer

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1234, "b": 4321}}\n</tool_call>'
FINAL = "The sum is 5555."


class ScriptedScheduler(spb_grpc.SchedulerServiceServicer):
    """Answers the i-th request with answers[i] (the last one from then on)."""

    def __init__(self, tokenizer, answers: list[str]) -> None:
        self.tokenizer = tokenizer
        self.answers = [tokenizer.encode(a, add_special_tokens=False) for a in answers]
        self.prompts: list[str] = []

    def Generate(self, request, context):
        self.prompts.append(self.tokenizer.decode(list(request.prompt_token_ids)))
        tokens = self.answers[min(len(self.prompts) - 1, len(self.answers) - 1)]
        for token in tokens:
            yield spb.GenerateResponse(chunk=spb.GenerateChunk(token_ids=[token]))
        yield spb.GenerateResponse(complete=spb.GenerateComplete(
            finish_reason=cpb.FINISH_REASON_STOP))

    def GetModelInfo(self, request, context):
        return spb.GetModelInfoResponse(model="/models/fake", max_model_len=MAX_MODEL_LEN,
                                        block_size=16, served_model_name=["fake-model"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mcp_server():
    """FastMCP "calculator" with `add` and `fail`, over SSE on 127.0.0.1."""
    from mcp.server.fastmcp import FastMCP

    calc = FastMCP("calculator")

    @calc.tool()
    def add(a: int, b: int) -> str:
        """Add two integers."""
        return str(a + b)

    @calc.tool()
    def fail(reason: str) -> str:
        """Always fails."""
        raise ValueError(reason)

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(calc.sse_app(), host="127.0.0.1", port=port,
                                           log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "MCP server did not start"
        time.sleep(0.05)
    yield f"127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def start(smollm2_tokenizer, grpc_server_factory, answers, tool_server):
    tokenizer = grpc_server_factory(tpb_grpc.add_TokenizerServiceServicer_to_server,
                                    TokenizerServicer(smollm2_tokenizer, "smollm2", [2]))
    fake = ScriptedScheduler(smollm2_tokenizer, answers)
    scheduler = grpc_server_factory(spb_grpc.add_SchedulerServiceServicer_to_server, fake)
    options = ServingOptions(enable_auto_tool_choice=True, tool_call_parser="hermes",
                             tool_server=tool_server)
    return AppServer(create_app(tokenizer.address, [scheduler.address], options=options)), fake


MCP_TOOLS = [{"type": "mcp", "server_label": "calculator", "server_url": "unused"}]


def test_the_gateway_calls_the_tool_and_feeds_the_result_back(
        mcp_server, smollm2_tokenizer, grpc_server_factory_module):
    app, fake = start(smollm2_tokenizer, grpc_server_factory_module, [CALL, FINAL], mcp_server)
    try:
        response = httpx.post(f"{app.url}/v1/responses", timeout=60, json={
            "model": "fake-model", "input": "What is 1234 + 4321?", "tools": MCP_TOOLS})
        assert response.status_code == 200, response.text
        body = response.json()
        call, message = body["output"]
        assert call["type"] == "mcp_call" and call["server_label"] == "calculator"
        assert (call["name"], call["output"], call["error"]) == ("add", "5555", None)
        assert message["content"][0]["text"] == FINAL and body["status"] == "completed"
        assert len(fake.prompts) == 2
        assert "5555" in fake.prompts[1] and "5555" not in fake.prompts[0]
        assert body["usage"]["output_tokens"] == sum(
            len(smollm2_tokenizer.encode(a, add_special_tokens=False)) for a in (CALL, FINAL))
        # The tool's failure is the call's error, which the model sees; no 500.
        fake.prompts.clear()
        fake.answers = [smollm2_tokenizer.encode(
            '<tool_call>\n{"name": "fail", "arguments": {"reason": "disk on fire"}}\n'
            "</tool_call>", add_special_tokens=False), fake.answers[1]]
        failed = httpx.post(f"{app.url}/v1/responses", timeout=60, json={
            "input": "Break it.", "tools": MCP_TOOLS}).json()
        assert "disk on fire" in failed["output"][0]["error"]
        assert "disk on fire" in fake.prompts[1]
        unknown = httpx.post(f"{app.url}/v1/responses", timeout=60, json={
            "input": "hi", "tools": [{"type": "mcp", "server_label": "nope"}]})
        assert unknown.status_code == 400 and "calculator" in unknown.json()["error"]["message"]
    finally:
        app.stop()


def test_an_unreachable_tool_server_is_a_clean_error(smollm2_tokenizer,
                                                     grpc_server_factory_module):
    app, fake = start(smollm2_tokenizer, grpc_server_factory_module, [FINAL],
                      f"127.0.0.1:{free_port()}")
    try:
        started = time.monotonic()
        response = httpx.post(f"{app.url}/v1/responses", timeout=120, json={
            "input": "hi", "tools": MCP_TOOLS})
        assert response.status_code == 424, response.text
        assert "Error retrieving tool list from MCP server" in response.json()["error"]["message"]
        assert time.monotonic() - started < 60 and fake.prompts == []
        assert httpx.post(f"{app.url}/v1/responses", timeout=60,
                          json={"input": "hi"}).status_code == 200  # still serving
    finally:
        app.stop()


def test_max_tool_calls_bounds_the_calls_the_gateway_runs(
        mcp_server, smollm2_tokenizer, grpc_server_factory_module):
    """A model that keeps calling: `max_tool_calls` calls run, then the response is
    incomplete with OpenAI's reason; without it the rounds' bound stops the loop."""
    app, fake = start(smollm2_tokenizer, grpc_server_factory_module, [CALL], mcp_server)
    try:
        body = httpx.post(f"{app.url}/v1/responses", timeout=60, json={
            "input": "Add forever.", "tools": MCP_TOOLS, "max_tool_calls": 2}).json()
        assert [item["type"] for item in body["output"]] == ["mcp_call", "mcp_call"]
        assert body["status"] == "incomplete"
        assert body["incomplete_details"] == {"reason": "max_tool_calls"}
        assert len(fake.prompts) == 3  # the third answer's call was not run
        fake.prompts.clear()
        body = httpx.post(f"{app.url}/v1/responses", timeout=60, json={
            "input": "Add forever.", "tools": MCP_TOOLS}).json()
        assert len(body["output"]) == MAX_ROUNDS and body["status"] == "incomplete"
        bad = httpx.post(f"{app.url}/v1/responses", timeout=60, json={
            "input": "x", "tools": MCP_TOOLS, "max_tool_calls": -1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tool_calls"
    finally:
        app.stop()
