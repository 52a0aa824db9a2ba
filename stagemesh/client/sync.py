"""stagemesh.Client: the gateway's calls as blocking Python methods."""

from __future__ import annotations

import os
from collections.abc import Iterable
from types import TracebackType
from typing import Unpack, overload

from stagemesh.client import calls
from stagemesh.client.channel import DEFAULT_RETRY, Connection, RetryPolicy
from stagemesh.client.errors import raising_call_errors
from stagemesh.client.requests import (
    GenerateOptions,
    ImageListOptions,
    OneImageOptions,
    VideoOptions,
    generation_params,
    video_params,
)
from stagemesh.client.results import ControlResult, GenerationResult, ProgressCallback, StageListing
from stagemesh.core import converters
from stagemesh.core.adapters import AdapterInfo
from stagemesh.v1 import control_pb2, gateway_pb2, gateway_pb2_grpc, generation_pb2


class Client:
    """A connection to one gateway. Thread-safe; use it as a context manager or close() it.

    Arguments win over the environment: `address` ($STAGEMESH_ADDRESS, else 127.0.0.1:50051),
    `tls_ca` a CA bundle (PEM) verifying a gateway that serves TLS ($STAGEMESH_TLS_CA; neither:
    plaintext), `token` the bearer token control calls carry ($STAGEMESH_TOKEN_FILE's content,
    else $STAGEMESH_TOKEN), `api_key` sent as x-api-key on every call ($STAGEMESH_API_KEY),
    `timeout` the deadline in seconds of each call that gives none (default 600), `retries` gRPC's
    retry policy for UNAVAILABLE (a RetryPolicy, or how many retries after the first attempt; 0
    turns retrying off). A CA bundle or token file that cannot be read raises
    stagemesh.StagemeshError here; every failed call raises a stagemesh.CallError subclass.
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        tls_ca: str | os.PathLike[str] | None = None,
        token: str | None = None,
        api_key: str | None = None,
        timeout: float | None = None,
        retries: int | RetryPolicy = DEFAULT_RETRY,
    ):
        self.connection = Connection.resolve(address, tls_ca, token, api_key, timeout, retries)
        self._channel = self.connection.open(aio=False)
        self._stub = gateway_pb2_grpc.GatewayServiceStub(self._channel)

    @property
    def address(self) -> str:
        return self.connection.address

    def __repr__(self) -> str:
        return f"Client({self.address!r})"

    def __enter__(self) -> Client:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Close the channel; calls still running end CANCELLED."""
        self._channel.close()

    @overload
    def generate(
        self, prompt: str, *, on_progress: ProgressCallback | None = ..., **options: Unpack[OneImageOptions]
    ) -> GenerationResult: ...

    @overload
    def generate(
        self, prompt: str, *, on_progress: ProgressCallback | None = ..., **options: Unpack[ImageListOptions]
    ) -> list[GenerationResult]: ...

    @overload
    def generate(
        self, prompt: str, *, on_progress: ProgressCallback | None = ..., **options: Unpack[GenerateOptions]
    ) -> GenerationResult | list[GenerationResult]: ...

    def generate(
        self, prompt: str, *, on_progress: ProgressCallback | None = None, **options: Unpack[GenerateOptions]
    ) -> GenerationResult | list[GenerationResult]:
        """Generate an image: one GenerationResult, or with `num_images` a list of them by index.

        Unset arguments take the gateway's defaults. `steps` is num_inference_steps; `seed` unset
        is random (reported in the result); `output_format` "png", "jpeg", "webp" or "tensor";
        `quality` 1-100 for JPEG and WebP; `init_image` (bytes, a path or a PIL image) with
        `strength` in (0, 1] makes it image-to-image. With `on_progress`, the call streams
        (Generate) and on_progress(event) runs for every event as it arrives; without, it is one
        GenerateUnary. The keywords are those of GenerateOptions.
        """
        params = generation_params(prompt, **options)
        request_id = options.get("request_id")
        deadline = self.connection.deadline(options.get("timeout"))
        if on_progress is None:
            results = self._generate_unary(params, request_id, deadline)
        else:
            results = self._generate_streaming(params, request_id, deadline, on_progress)
        return results if options.get("num_images") is not None else results[0]

    def _generate_unary(
        self, params: generation_pb2.GenerationParams, request_id: str | None, deadline: float
    ) -> list[GenerationResult]:
        with raising_call_errors():
            reply = self._stub.GenerateUnary(
                calls.unary_request(params, request_id), timeout=deadline, metadata=self.connection.metadata()
            )
        return calls.unary_results(reply)

    def _generate_streaming(
        self,
        params: generation_pb2.GenerationParams,
        request_id: str | None,
        deadline: float,
        on_progress: ProgressCallback | None,
    ) -> list[GenerationResult]:
        collected = calls.Collected()
        with raising_call_errors():
            stream = self._stub.Generate(
                calls.stream_request(params, request_id), timeout=deadline, metadata=self.connection.metadata()
            )
            try:
                for message in stream:
                    event = collected.add(message)
                    if event is not None and on_progress is not None:
                        on_progress(event)
            finally:
                stream.cancel()  # a no-op once the stream ended; frees the gateway when on_progress raised
        return collected.results()

    def generate_video(
        self, prompt: str, *, on_progress: ProgressCallback | None = None, **options: Unpack[VideoOptions]
    ) -> GenerationResult:
        """Generate a video: one GenerationResult whose `frames` are the video's (MP4 by default;
        "webp" is animated WebP, "tensor" the float frames). `num_frames` and `fps` unset take the
        model's defaults; `init_image` is the first frame of an image-to-video model. Always a
        Generate stream: a large video arrives in chunks, put back together here; on_progress(event)
        runs for each progress event. The keywords are those of VideoOptions."""
        params = video_params(prompt, **options)
        deadline = self.connection.deadline(options.get("timeout"))
        return self._generate_streaming(params, options.get("request_id"), deadline, on_progress)[0]

    def list_stages(self, *, timeout: float | None = None) -> StageListing:
        """The stages behind the gateway (id, kind, state, replicas, sleep level, device memory) and
        whether generation is paused."""
        with raising_call_errors():
            reply = self._stub.ListStages(
                gateway_pb2.ListStagesRequest(),
                timeout=self.connection.deadline(timeout),
                metadata=self.connection.metadata(),
            )
        return StageListing.from_proto(reply)

    def sleep(
        self, stage_ids: Iterable[int] | None = None, level: int = 2, *, timeout: float | None = None
    ) -> ControlResult:
        """Put stages to sleep (every stage when `stage_ids` is None): level 1 keeps the weights in
        host memory, level 2 discards them (reloaded on wake). Generate is refused while a stage
        sleeps; after wake_up, a pipeline with an AR stage stays paused until resume(). The
        result's acks say what each worker freed."""
        ids = self._stage_ids(stage_ids, timeout)
        with raising_call_errors():
            reply = self._stub.Sleep(
                calls.sleep_request(ids, level),
                timeout=self.connection.deadline(timeout),
                metadata=self.connection.metadata(control=True),
            )
        return ControlResult.from_proto(reply)

    def wake_up(self, stage_ids: Iterable[int] | None = None, *, timeout: float | None = None) -> ControlResult:
        """Wake the listed stages that sleep (every stage when `stage_ids` is None); SKIPPED when none does."""
        ids = self._stage_ids(stage_ids, timeout)
        with raising_call_errors():
            reply = self._stub.WakeUp(
                calls.wake_request(ids),
                timeout=self.connection.deadline(timeout),
                metadata=self.connection.metadata(control=True),
            )
        return ControlResult.from_proto(reply)

    def pause(self, *, timeout: float | None = None) -> None:
        """Stop admitting Generate calls (they get FailedPreconditionError) until resume()."""
        with raising_call_errors():
            self._stub.PauseGeneration(
                gateway_pb2.PauseGenerationRequest(),
                timeout=self.connection.deadline(timeout),
                metadata=self.connection.metadata(control=True),
            )

    def resume(self, *, timeout: float | None = None) -> None:
        """Admit Generate calls again."""
        with raising_call_errors():
            self._stub.ResumeGeneration(
                gateway_pb2.ResumeGenerationRequest(),
                timeout=self.connection.deadline(timeout),
                metadata=self.connection.metadata(control=True),
            )

    def load_adapter(self, name: str, path: str, *, timeout: float | None = None) -> list[AdapterInfo]:
        """Load a LoRA adapter on every stage holding the diffusion transformer, from `path`
        inside each stage's lora_dir; one AdapterInfo per worker. Needs the control token."""
        with raising_call_errors():
            reply = self._stub.LoadAdapter(
                control_pb2.LoadAdapterRequest(name=name, path=path),
                timeout=self.connection.deadline(timeout),
                metadata=self.connection.metadata(control=True),
            )
        return [converters.adapter_info_from_proto(a) for a in reply.adapters]

    def unload_adapter(self, name: str, *, timeout: float | None = None) -> list[int]:
        """Drop a LoRA adapter everywhere; the ids of the stages that held it (NotFoundError: none)."""
        with raising_call_errors():
            reply = self._stub.UnloadAdapter(
                control_pb2.UnloadAdapterRequest(name=name),
                timeout=self.connection.deadline(timeout),
                metadata=self.connection.metadata(control=True),
            )
        return list(reply.stage_ids)

    def list_adapters(self, *, timeout: float | None = None) -> list[AdapterInfo]:
        """Every LoRA adapter as each worker holds it (bytes, on the device or in host memory)."""
        with raising_call_errors():
            reply = self._stub.ListAdapters(
                control_pb2.ListAdaptersRequest(),
                timeout=self.connection.deadline(timeout),
                metadata=self.connection.metadata(control=True),
            )
        return [converters.adapter_info_from_proto(a) for a in reply.adapters]

    def _stage_ids(self, stage_ids: Iterable[int] | None, timeout: float | None) -> list[int]:
        if stage_ids is not None:
            return list(stage_ids)
        # Part of a control call: the listing carries the token too, which a gateway whose data
        # plane needs an API key accepts in its place.
        with raising_call_errors():
            reply = self._stub.ListStages(
                gateway_pb2.ListStagesRequest(),
                timeout=self.connection.deadline(timeout),
                metadata=self.connection.metadata(control=True),
            )
        return [s.stage_id for s in reply.stages]
