"""``staleflow serve reward``: the reward server in the foreground.

Also runnable on its own (``python -m staleflow.cli.serve_reward ...``) with the same options."""

from __future__ import annotations

import logging
from typing import Annotated

import typer
from pydantic import ValidationError

from staleflow.cli.common import fail, validation_failure
from staleflow.config import RewardConfig, default_of


def _parse_verifiers(specs: list[str]) -> dict[str, str]:
    verifiers = {}
    for spec in specs:
        name, sep, target = spec.partition("=")
        if not sep or not name or not target:
            raise fail(f"--verifier {spec!r} is not NAME=module.path:function",
                       "for example --verifier gsm8k=my_rewards.gsm8k:score")
        verifiers[name.strip()] = target.strip()
    return verifiers


def register(serve_app: typer.Typer) -> None:
    @serve_app.command("reward")
    def serve_reward(
        verifier: Annotated[list[str] | None, typer.Option(
            "--verifier", help="a user verifier NAME=module.path:function (repeatable)")] = None,
        default: Annotated[str, typer.Option("--default", help="verifier for requests that name none")]
        = default_of(RewardConfig, "default_verifier"),
        workers: Annotated[int, typer.Option(help="processes running the verifiers")] = default_of(RewardConfig, "workers"),
        timeout_s: Annotated[float, typer.Option("--timeout", help="deadline in seconds per item, for every verifier")]
        = default_of(RewardConfig, "timeout_s"),
        host: Annotated[str, typer.Option(help="bind address")] = default_of(RewardConfig, "host"),
        port: Annotated[int, typer.Option(help="bind port")] = default_of(RewardConfig, "port"),
        token: Annotated[str | None, typer.Option(help="bearer token for mutating requests (default: $STALEFLOW_TOKEN)")] = None,
    ) -> None:
        """The reward server: rule-based verifiable rewards (math answers, exact match, your own)."""
        from staleflow.cli.serve_params import serve_owning
        from staleflow.rewards import RewardScorer, VerifierError
        from staleflow.servers.reward import create_app

        try:
            config = RewardConfig(verifiers=_parse_verifiers(verifier or []), default_verifier=default,
                                  workers=workers, timeout_s=timeout_s, host=host, port=port)
        except ValidationError as exc:
            raise validation_failure(exc, {"default_verifier": "--default", "timeout_s": "--timeout",
                                           "verifiers": "--verifier"}) from None
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        try:  # start the workers first: a verifier that does not import stops us here, with its error
            scorer = RewardScorer(config.verifiers, config.default_verifier, config.workers, config.timeout_s)
        except VerifierError as exc:
            raise fail(str(exc), "check the --verifier paths are importable (PYTHONPATH)") from None
        serve_owning(scorer, create_app(config, scorer, owns_scorer=True), config.host, config.port, token)


if __name__ == "__main__":
    standalone = typer.Typer(add_completion=False)
    register(standalone)
    standalone(prog_name="staleflow serve reward")
