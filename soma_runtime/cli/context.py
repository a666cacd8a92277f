"""The `context` command (SPEC "context API", CLI): show, tokens, blocks, compress, clear, budget, save and
load a conversation's context, on a running server's session (`--session ID`, `--url`) or in a saved
session file (`--file`, with the model it is for loaded here; changes are written back)."""
from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

from soma_runtime.context import read_session
from soma_runtime.errors import RequestError

ACTIONS = ("show", "tokens", "blocks", "compress", "clear", "budget", "save", "load")
CHANGES = ("compress", "clear", "budget")      # what a file is written back after


def add_parser(sub) -> None:
    c = sub.add_parser("context", help="show or manage a conversation's context: a server's session or a saved file")
    c.add_argument("action", choices=ACTIONS)
    c.add_argument("args", nargs="*", metavar="ARG",
                   help="clear: history|all|session; budget: BLOCK TOKENS (TOKENS 'none' for no budget); save/load: FILE")
    where = c.add_mutually_exclusive_group(required=True)
    where.add_argument("--session", help="a running server's session id")
    where.add_argument("--file", help="a saved session file (its model is loaded here)")
    c.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default: http://127.0.0.1:8000)")
    c.add_argument("--api-key", default=None, help="its API key (default: $SOMA_API_KEY)")
    c.add_argument("--model", "-m", default=None,
                   help="with --file: the model the session is for (default: the bundled SmolLM2); with load: the "
                        "server's model id (default: the one it was saved from)")
    c.add_argument("--json", action="store_true", help="print the answer as JSON")
    c.set_defaults(run=cmd_context)


def cmd_context(args) -> int:
    wanted = {"clear": (0, 1), "budget": (2, 2), "save": (1, 1), "load": (1, 1)}.get(args.action, (0, 0))
    if not wanted[0] <= len(args.args) <= wanted[1]:
        raise RequestError(f"context {args.action} takes {wanted[1] if wanted[0] == wanted[1] else 'at most 1'} "
                           f"argument(s), got {len(args.args)}")
    answer = in_file(args) if args.file else on_server(args)
    if args.json or args.action == "save":
        print(json.dumps(answer, indent=2))
    elif args.action == "show":
        print(answer["text"])
    elif args.action == "tokens":
        print(f"total: {answer['tokens']} / {answer['window']} (the prompt may take {answer['limit']})")
    else:
        print_blocks(answer)
    return 0


def print_blocks(report: dict) -> None:
    print(f"total: {report['tokens']} / {report['window']} (the prompt may take {report['limit']})")
    for b in report["blocks"]:
        budget = f" / {b['budget']}" if b["budget"] is not None else ""
        cut, compressed = b["cut"], b["compressed"]
        lost = (f"  cut {cut['entries']} ({cut['tokens']} tokens)" if cut["entries"] else "") + \
               (f"  compressed {compressed['entries']} ({compressed['tokens']} tokens)" if compressed["entries"] else "")
        print(f"  {b['block']:13s}{b['tokens']:7d}{budget}{lost}")


def budget_args(args) -> tuple[str, int | None]:
    block, tokens = args.args
    if tokens == "none":
        return block, None
    if not tokens.isdigit():
        raise RequestError(f"context budget {block} TOKENS: a count of tokens or 'none', got {tokens!r}")
    return block, int(tokens)


def on_server(args) -> dict:
    """The answer of the server's /v1/context/<action> for the session."""
    body: dict = {"session": args.session}
    if args.action == "clear" and args.args:
        body["what"] = args.args[0]
    elif args.action == "budget":
        body["block"], body["tokens"] = budget_args(args)
    elif args.action == "load":
        body["state"] = read_session(args.args[0])
        body["model"] = args.model or body["state"].get("model")
    answer = post(args, f"/v1/context/{args.action}", body)
    if args.action == "save":
        with open(args.args[0], "w", encoding="utf-8") as f:
            json.dump(answer, f, ensure_ascii=False)
    return answer


def in_file(args) -> dict:
    """The same answers for a saved session file, through its model loaded here; changes written back."""
    from soma_runtime.tasks import Runtime
    if args.action == "load":
        raise RequestError("context load puts a saved file on a server's session: give --session, not --file")
    if args.action == "clear" and args.args not in ([], ["history"], ["all"]):
        raise RequestError(f"context clear on a file takes history or all, got {args.args[0]!r}")
    model = Runtime().load(args.model, progress=False)
    context = model.context(summarizer=model)
    context.load(args.file)
    if args.action == "clear":
        (context.reset if args.args == ["all"] else context.clear_history)()
    elif args.action == "budget":
        context.set_budget(*budget_args(args))
    elif args.action == "compress":
        context.compress()
    if args.action in CHANGES:
        context.save(args.file)
    if args.action == "save":
        context.save(args.args[0])
        return context.state()
    return {"text": context.show(), **context.report()} if args.action == "show" else context.report()


def post(args, path: str, body: dict) -> dict:
    request = urllib.request.Request(args.url.rstrip("/") + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    key = args.api_key or os.environ.get("SOMA_API_KEY")
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return json.load(response)
    except urllib.error.HTTPError as e:
        try:
            message = json.load(e)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = e.reason
        raise RequestError(f"{args.url}{path}: {e.code} {message}") from None
    except OSError as e:
        raise RequestError(f"no server answers at {args.url}: {e}") from None

