"""The command line: ``ndtrain train | plan | config | generate | eval | convert`` (``main``), the
launcher that validates once and spawns or joins the ranks (``launch``, ``spawn``, ``preflight``),
re-run handling (``rerun``), ``ndtrain plan`` (``plan``) and the after-training commands (``after``,
``convert``)."""


def main(argv=None):
    """The ``ndtrain`` console script (``ndtrain.cli.commands.main``)."""
    from ndtrain.cli.commands import main as _main
    return _main(argv)
