#!/usr/bin/env python3
"""An MCP server of the official Python SDK, for paceline's integration tests.

Speaks the streamable HTTP transport at http://HOST:PORT/mcp with the SDK it
finds: `mcp` 2.x (MCPServer: the stateless 2026-07-28 revision and the
session revisions before it) or 1.x (FastMCP: 2025-11-25 and before, with
sessions unless --stateless). Each tool call appends one JSON line to --log:
the tool, its arguments and the headers paceline sent.

    python3 server.py --port 8765 --log calls.jsonl [--stateless] [--many N]
"""
import argparse
import json

try:
    from mcp.server.mcpserver import Context, MCPServer as Server  # mcp 2.x
    from mcp.server.mcpserver.exceptions import ToolError

    SDK = 2
except ImportError:
    from mcp.server.fastmcp import Context, FastMCP as Server  # mcp 1.x
    from mcp.server.fastmcp.exceptions import ToolError

    SDK = 1

p = argparse.ArgumentParser()
p.add_argument("--host", default="127.0.0.1")
p.add_argument("--port", type=int, required=True)
p.add_argument("--log", required=True)
p.add_argument("--stateless", action="store_true", help="no Mcp-Session-Id (legacy revisions)")
p.add_argument("--many", type=int, default=0, help="N more tools, filler_0 ... filler_N-1")
args = p.parse_args()

if SDK == 2:
    mcp = Server("paceline-test", version="1.0.0")
else:
    mcp = Server("paceline-test", host=args.host, port=args.port, stateless_http=args.stateless)


def record(ctx, tool, arguments):
    request = ctx.request_context.request
    headers = dict(request.headers) if request is not None else {}
    entry = {
        "tool": tool,
        "arguments": arguments,
        "authorization": headers.get("authorization"),
        "mcp_session_id": headers.get("mcp-session-id"),
        "mcp_protocol_version": headers.get("mcp-protocol-version"),
        "sdk": SDK,
    }
    with open(args.log, "a") as f:
        f.write(json.dumps(entry) + "\n")


@mcp.tool(description="Echoes the message back.", structured_output=False)
def echo(message: str, ctx: Context) -> str:
    record(ctx, "echo", {"message": message})
    return f"echo: {message}"


@mcp.tool(description="Answers 40 000 characters.", structured_output=False)
def big(ctx: Context) -> str:
    record(ctx, "big", {})
    return "b" * 40_000


@mcp.tool(description="Answers 50 MiB.", structured_output=False)
def huge(ctx: Context) -> str:
    record(ctx, "huge", {})
    return "h" * (50 << 20)


@mcp.tool(description="Always fails (an error the model may read: the SDK's ToolError).", structured_output=False)
def fail(ctx: Context) -> str:
    record(ctx, "fail", {})
    raise ToolError("the disk is on fire")


@mcp.tool(description="Never offered: the runs' allowed_tools leave it out.", structured_output=False)
def hidden(ctx: Context) -> str:
    record(ctx, "hidden", {})
    return "you should not see this"


def filler(i):
    def tool() -> str:
        return f"filler {i}"

    tool.__name__ = f"filler_{i}"
    mcp.tool(name=f"filler_{i}", description=f"Filler tool {i}.", structured_output=False)(tool)


for i in range(args.many):
    filler(i)

if __name__ == "__main__":
    if SDK == 2:
        mcp.run(transport="streamable-http", host=args.host, port=args.port, stateless_http=args.stateless)
    else:
        mcp.run(transport="streamable-http")
