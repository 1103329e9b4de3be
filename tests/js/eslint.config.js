// ESLint for the status page's scripts (run from the repository root by
// tests/test_console_js.py: tests/js/node_modules/.bin/eslint -c tests/js/eslint.config.js).
"use strict";

const js = require("@eslint/js");
const globals = require("globals");

module.exports = [
  js.configs.recommended,
  {
    files: ["gatewayd/http/*.js"],
    languageOptions: {
      ecmaVersion: 2022,
      sourceType: "script",
      globals: { ...globals.browser, module: "readonly" },
    },
    rules: {
      "no-unused-vars": ["error", { args: "none" }],
      eqeqeq: ["error", "smart"],
      "no-var": "error",
      "prefer-const": "error",
      "no-shadow": "error",
    },
  },
  {
    files: ["tests/js/*.js"],
    languageOptions: { ecmaVersion: 2022, sourceType: "commonjs", globals: globals.node },
  },
];
