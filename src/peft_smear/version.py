"""The package version, in a module of its own so that modules of the package can name it without importing the
package itself."""

__version__ = "0.1.0"
