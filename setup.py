"""Build hook: put the start-up .pth file at the top of the wheel (so into site-packages).

Everything else about the package is in pyproject.toml. Editable installs do not get the
.pth file; see hooks/README.md.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "mlx_recovery_plugin.pth"


class build_py_with_pth(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(str(Path(__file__).parent / "hooks" / PTH), str(Path(self.build_lib) / PTH))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH)]


setup(cmdclass={"build_py": build_py_with_pth})
