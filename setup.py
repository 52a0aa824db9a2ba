"""The build as pyproject.toml declares it, plus one step: the API's .proto sources (protos/) go
into the wheel's stagemesh/v1/, beside the stubs generated from them, so that an installation is
an include root for protoc and grpcurl."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PROTOS = Path(__file__).resolve().parent / "protos"


class BuildWithProtos(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:  # an editable install reads protos/ in the checkout
            return
        for source in sorted((PROTOS / "stagemesh" / "v1").glob("*.proto")):
            self.copy_file(str(source), str(Path(self.build_lib) / "stagemesh" / "v1" / source.name))


setup(cmdclass={"build_py": BuildWithProtos})
