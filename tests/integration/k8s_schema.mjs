// Validates Kubernetes objects against the API's OpenAPI schemas as shipped
// by the npm kubernetes-models package (installed by `npm ci --prefix
// tests/reference`): types, enums, formats and required fields.
//
//   node k8s_schema.mjs < OBJECTS_JSON
//
// OBJECTS_JSON: [{"where": TEXT, "model": "apps/v1/Deployment", "object": {...}}, ...]
// Prints one JSON list of {"where", "error"} (empty when all are valid); exit
// status 2 when a model is unknown.
import { existsSync, readFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const models = join(here, "..", "reference", "node_modules", "kubernetes-models");

const items = JSON.parse(readFileSync(0, "utf8"));
const errors = [];
for (const { where, model, object } of items) {
  const file = join(models, model + ".js");
  if (!existsSync(file)) {
    console.error(`k8s_schema: no model ${model} in ${models}`);
    process.exit(2);
  }
  const mod = await import(pathToFileURL(file).href);
  const Model = mod[model.split("/").pop()];
  try {
    new Model(object).validate();
  } catch (e) {
    errors.push({ where, error: e.message });
  }
}
console.log(JSON.stringify(errors));
