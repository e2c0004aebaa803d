/* The bench's reports: the text summary per rate and for a sweep, the JSON
 * result (vLLM's keys, as `vllm bench serve --save-result` writes them,
 * plus Loom's), and gnuplot plots of latency against rate and of the
 * server-side stage breakdown. */
#include <errno.h>
#include <math.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "client/bench/bench.h"
#include "common/util.h"

extern char **environ;

static void rate_label(double rate, char *out, size_t n) {
    if (isfinite(rate))
        snprintf(out, n, "%g", rate);
    else
        snprintf(out, n, "inf");
}

/* A latency cell; "-" when there were no samples. */
static void print_ms(double x, int width) {
    if (isfinite(x))
        printf("%*.2f", width, x);
    else
        printf("%*s", width, "-");
}

/* percentiles the table always has (median, p90, p99) */
static int shown(double p) {
    return p == 50 || p == 90 || p == 99;
}

void bench_print_result(const bench_result_t *r, const bench_report_cfg_t *cfg) {
    char rl[32], mc[32];
    rate_label(r->rate, rl, sizeof rl);
    if (cfg->max_concurrency)
        snprintf(mc, sizeof mc, "%d", cfg->max_concurrency);
    else
        snprintf(mc, sizeof mc, "unlimited");
    const char *arrivals = !isfinite(r->rate)       ? "all at once"
                           : cfg->burstiness == 1.0 ? "Poisson arrivals"
                                                    : "gamma arrivals";
    printf("\n---- rate %s req/s (%s", rl, arrivals);
    if (isfinite(r->rate) && cfg->burstiness != 1.0) printf(", burstiness %g", cfg->burstiness);
    printf("), %d requests, max concurrency %s ----\n", r->n, mc);
    printf("%-28s %d\n", "successful requests", r->completed);
    printf("%-28s %d\n", "failed requests", r->failed);
    printf("%-28s %.2f s\n", "duration", r->duration_s);
    printf("%-28s %d\n", "peak requests in flight", r->peak_in_flight);
    printf("%-28s %.2f req/s\n", "request throughput", r->req_per_s);
    if (cfg->goodput && cfg->goodput->any)
        printf("%-28s %.2f req/s (%d good)\n", "request goodput", r->goodput_per_s, r->good);
    printf("%-28s %.1f tok/s\n", "output token throughput", r->out_tok_per_s);
    printf("%-28s %.1f tok/s\n", "peak output tokens/s", r->max_output_tokens_per_s);
    printf("%-28s %.1f tok/s\n", "total token throughput", r->total_tok_per_s);
    printf("%-28s %lld\n", "input tokens", r->in_tokens);
    printf("%-28s %lld\n", "output tokens", r->out_tokens);
    if (r->n_cached_said > 0)
        printf("%-28s %lld (prefix-cache hit rate %.1f%%)\n", "cached prompt tokens",
               r->cached_tokens,
               r->in_tokens ? 100.0 * (double)r->cached_tokens / (double)r->in_tokens : 0.0);
    printf("%-8s %10s %10s %10s %10s %10s", "", "mean", "median", "std", "p90", "p99");
    for (int k = 0; k < cfg->n_pcts; k++) {
        if (shown(cfg->pcts[k])) continue;
        char h[16];
        snprintf(h, sizeof h, "p%g", cfg->pcts[k]);
        printf(" %10s", h);
    }
    printf("   (ms)\n");
    const struct {
        const char *name;
        const bench_stat_t *s;
    } rows[] = {{"TTFT", &r->ttft}, {"TPOT", &r->tpot}, {"ITL", &r->itl}, {"E2E", &r->e2e}};
    for (size_t i = 0; i < LOOM_ARRAY_LEN(rows); i++) {
        printf("%-8s", rows[i].name);
        const double v[5] = {rows[i].s->mean, rows[i].s->median, rows[i].s->std, rows[i].s->p90,
                             rows[i].s->p99};
        for (int k = 0; k < 5; k++)
            print_ms(v[k], 11);
        for (int k = 0; k < cfg->n_pcts; k++)
            if (!shown(cfg->pcts[k])) print_ms(rows[i].s->pct[k], 11);
        putchar('\n');
    }
    if (r->stages[0].n > 0) {
        printf("stage breakdown on the server, %d requests (ms; detokenize and send are inside "
               "prefill and decode):\n",
               r->stages[0].n);
        printf("%-11s %10s %10s %10s\n", "", "mean", "p50", "p99");
        for (int k = 0; k < BENCH_ST_COUNT; k++) {
            printf("%-11s", bench_stage_names[k]);
            const double v[3] = {r->stages[k].mean, r->stages[k].p50, r->stages[k].p99};
            for (int j = 0; j < 3; j++)
                print_ms(v[j], 11);
            putchar('\n');
        }
    }
    if (r->n_turns > 0) {
        printf("per turn of the chats:\n%-5s %9s %7s %12s %10s %10s %10s\n", "turn", "completed",
               "failed", "mean prompt", "cached", "TTFT p50", "TTFT p99");
        for (int k = 0; k < r->n_turns; k++) {
            const struct bench_turn_stat *ts = &r->turns[k];
            printf("%-5d %9d %7d %12.1f", k + 1, ts->completed, ts->failed, ts->prompt_mean);
            if (isfinite(ts->cached_frac))
                printf(" %9.1f%%", 100.0 * ts->cached_frac);
            else
                printf(" %10s", "-");
            print_ms(ts->ttft_p50, 11);
            print_ms(ts->ttft_p99, 11);
            putchar('\n');
        }
    }
    for (int k = 0; k < r->n_error_kinds; k++)
        printf("error (%d x): %s\n", r->error_counts[k], r->errors[k]);
    fflush(stdout);
}

void bench_print_sweep(const bench_result_t *res, int n) {
    printf("\n%-8s %8s %10s %10s %10s %10s %10s %10s %7s\n", "rate", "req/s", "out tok/s",
           "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "E2E p50", "failed");
    for (int i = 0; i < n; i++) {
        const bench_result_t *r = &res[i];
        char rl[32];
        rate_label(r->rate, rl, sizeof rl);
        if (r->skipped) {
            printf("%-8s skipped: the --timeout-s limit was reached\n", rl);
            continue;
        }
        printf("%-8s %8.2f %10.1f", rl, r->req_per_s, r->out_tok_per_s);
        const double v[5] = {r->ttft.p50, r->ttft.p99, r->tpot.p50, r->tpot.p99, r->e2e.p50};
        for (int k = 0; k < 5; k++)
            print_ms(v[k], 11);
        printf(" %7d\n", r->failed);
    }
    printf("(latencies in ms)\n");
    fflush(stdout);
}

/* ---- JSON ---- */

static void json_str(FILE *f, const char *s) {
    fputc('"', f);
    for (; s && *s; s++) {
        unsigned char ch = (unsigned char)*s;
        if (ch == '"' || ch == '\\')
            fprintf(f, "\\%c", ch);
        else if (ch == '\n')
            fputs("\\n", f);
        else if (ch < 0x20)
            fprintf(f, "\\u%04x", ch);
        else
            fputc(ch, f);
    }
    fputc('"', f);
}

static void json_num(FILE *f, double x) {
    if (isfinite(x))
        fprintf(f, "%.6g", x);
    else
        fputs("null", f);
}

/* vLLM writes 0 for a metric without samples */
static void json_num0(FILE *f, double x) {
    json_num(f, isfinite(x) ? x : 0.0);
}

static void key(FILE *f, const char *k) {
    fprintf(f, ",\n    \"%s\": ", k);
}

static void json_stat(FILE *f, const char *name, const bench_stat_t *s) {
    fprintf(f, ",\n    \"%s\": {\"n\": %d, \"mean\": ", name, s->n);
    json_num(f, s->mean);
    fputs(", \"p50\": ", f);
    json_num(f, s->p50);
    fputs(", \"p90\": ", f);
    json_num(f, s->p90);
    fputs(", \"p99\": ", f);
    json_num(f, s->p99);
    fputc('}', f);
}

/* vLLM's mean_/median_/std_/pNN_ keys of one metric. */
static void vllm_stat(FILE *f, const char *name, const bench_stat_t *s,
                      const bench_report_cfg_t *cfg) {
    char k[64];
    snprintf(k, sizeof k, "mean_%s_ms", name);
    key(f, k), json_num0(f, s->mean);
    snprintf(k, sizeof k, "median_%s_ms", name);
    key(f, k), json_num0(f, s->median);
    snprintf(k, sizeof k, "std_%s_ms", name);
    key(f, k), json_num0(f, s->std);
    for (int i = 0; i < cfg->n_pcts; i++) {
        snprintf(k, sizeof k, "p%g_%s_ms", cfg->pcts[i], name);
        key(f, k), json_num0(f, s->pct[i]);
    }
}

static int metric_selected(const char *list, const char *name) {
    size_t n = strlen(name);
    for (const char *p = list; p && *p;) {
        size_t l = strcspn(p, ",");
        if (l == n && !strncmp(p, name, n)) return 1;
        p += l + (p[l] == ',');
    }
    return 0;
}

static void json_result(FILE *f, const bench_result_t *r, const bench_report_cfg_t *cfg,
                        bench_rec_t *recs, int n_recs) {
    char date[32];
    time_t now = time(NULL);
    strftime(date, sizeof date, "%Y%m%d-%H%M%S", localtime(&now));
    fputs("  {\n    \"date\": ", f);
    json_str(f, date);
    key(f, "endpoint_type"), json_str(f, cfg->backend);
    key(f, "backend"), json_str(f, cfg->backend);
    key(f, "label"), json_str(f, cfg->backend);
    key(f, "model_id"), json_str(f, cfg->model);
    key(f, "tokenizer_id"), json_str(f, cfg->model);
    key(f, "num_prompts"), fprintf(f, "%d", cfg->num_requests);
    key(f, "request_rate");
    if (isfinite(r->rate))
        json_num(f, r->rate);
    else
        fputs("\"inf\"", f);
    key(f, "burstiness"), json_num(f, cfg->burstiness);
    key(f, "max_concurrency");
    if (cfg->max_concurrency)
        fprintf(f, "%d", cfg->max_concurrency);
    else
        fputs("null", f);
    key(f, "duration"), json_num(f, r->duration_s);
    key(f, "completed"), fprintf(f, "%d", r->completed);
    key(f, "failed"), fprintf(f, "%d", r->failed);
    key(f, "total_input_tokens"), fprintf(f, "%lld", r->in_tokens);
    key(f, "total_output_tokens"), fprintf(f, "%lld", r->out_tokens);
    key(f, "request_throughput"), json_num(f, r->req_per_s);
    key(f, "request_goodput");
    if (cfg->goodput && cfg->goodput->any)
        json_num(f, r->goodput_per_s);
    else
        fputs("null", f);
    key(f, "output_throughput"), json_num(f, r->out_tok_per_s);
    key(f, "total_token_throughput"), json_num(f, r->total_tok_per_s);
    if (recs) { /* --save-detailed: per request, in seconds, as vLLM has them */
        const char *lists[] = {"input_lens",  "output_lens",     "ttfts",
                               "itls",        "latencies",       "start_times",
                               "queue_times", "generated_texts", "errors"};
        for (size_t l = 0; l < LOOM_ARRAY_LEN(lists); l++) {
            key(f, lists[l]);
            fputc('[', f);
            for (int i = 0; i < n_recs; i++) {
                const bench_rec_t *q = &recs[i];
                int ok = q->status == LOOM_OK;
                if (i) fputs(", ", f);
                switch (l) {
                case 0:
                    fprintf(f, "%d",
                            q->prompt_tokens > 0 ? q->prompt_tokens
                            : q->sent_ids        ? q->n_sent
                                                 : q->item->prompt_len);
                    break;
                case 1:
                    fprintf(f, "%d",
                            ok ? (q->completion_tokens > 0 ? q->completion_tokens : q->tokens_seen)
                               : 0);
                    break;
                case 2:
                    json_num(f, ok && q->n_chunks ? q->t_first - q->t_send : 0.0);
                    break;
                case 3:
                    fputc('[', f);
                    for (int k = 1; ok && k < q->n_chunks; k++) {
                        if (k > 1) fputs(", ", f);
                        json_num(f, q->chunk_t[k] - q->chunk_t[k - 1]);
                    }
                    fputc(']', f);
                    break;
                case 4:
                    json_num(f, ok ? q->t_end - q->t_send : 0.0);
                    break;
                case 5:
                    json_num(f, q->t_send);
                    break;
                case 6:
                    json_num(f, q->t_send - q->t_arrival > 0 ? q->t_send - q->t_arrival : 0.0);
                    break;
                case 7:
                    json_str(f, q->text ? q->text : "");
                    break;
                default:
                    json_str(f, ok ? "" : q->msg);
                    break;
                }
            }
            fputc(']', f);
        }
    }
    if (r->n_cached_said > 0) {
        key(f, "cached_prompt_tokens"), fprintf(f, "%lld", r->cached_tokens);
        key(f, "prefix_cache_hit_rate");
        json_num(f, r->in_tokens ? (double)r->cached_tokens / (double)r->in_tokens : 0.0);
    }
    if (r->n_turns > 0) {
        key(f, "turns");
        fputc('[', f);
        for (int k = 0; k < r->n_turns; k++) {
            const struct bench_turn_stat *ts = &r->turns[k];
            fprintf(f, "%s{\"turn\": %d, \"completed\": %d, \"failed\": %d, \"mean_prompt_len\": ",
                    k ? ", " : "", k + 1, ts->completed, ts->failed);
            json_num(f, ts->prompt_mean);
            fputs(", \"prefix_cache_hit_rate\": ", f);
            json_num(f, ts->cached_frac);
            fputs(", \"p50_ttft_ms\": ", f);
            json_num(f, ts->ttft_p50);
            fputs(", \"p99_ttft_ms\": ", f);
            json_num(f, ts->ttft_p99);
            fputc('}', f);
        }
        fputc(']', f);
    }
    key(f, "max_output_tokens_per_s"), json_num(f, r->max_output_tokens_per_s);
    key(f, "max_concurrent_requests"), fprintf(f, "%d", r->max_concurrent_requests);
    const struct {
        const char *name;
        const bench_stat_t *s;
    } m[] = {{"ttft", &r->ttft}, {"tpot", &r->tpot}, {"itl", &r->itl}, {"e2el", &r->e2e}};
    for (size_t i = 0; i < LOOM_ARRAY_LEN(m); i++)
        if (metric_selected(cfg->percentile_metrics, m[i].name))
            vllm_stat(f, m[i].name, m[i].s, cfg);
    /* Loom's own */
    key(f, "rate");
    if (isfinite(r->rate))
        json_num(f, r->rate);
    else
        fputs("\"inf\"", f);
    key(f, "api"), json_str(f, cfg->backend);
    key(f, "endpoint"), json_str(f, cfg->endpoint);
    key(f, "base_url"), json_str(f, cfg->base_url);
    key(f, "model"), json_str(f, cfg->model);
    key(f, "dataset_name"), json_str(f, cfg->dataset);
    key(f, "skipped"), fputs(r->skipped ? "true" : "false", f);
    key(f, "num_requests"), fprintf(f, "%d", r->n);
    key(f, "peak_in_flight"), fprintf(f, "%d", r->peak_in_flight);
    key(f, "prompt_len"), fprintf(f, "%d", cfg->prompt_len);
    key(f, "prompt_len_range"), json_num(f, cfg->prompt_range);
    key(f, "output_len"), fprintf(f, "%d", cfg->output_len);
    key(f, "output_len_range"), json_num(f, cfg->output_range);
    key(f, "temperature"), json_num(f, cfg->temperature);
    key(f, "seed"), fprintf(f, "%llu", (unsigned long long)cfg->seed);
    key(f, "duration_s"), json_num(f, r->duration_s);
    if (cfg->goodput && cfg->goodput->any) {
        key(f, "goodput_slo_ms");
        fputs("{\"ttft\": ", f);
        json_num(f, cfg->goodput->ttft_ms >= 0 ? cfg->goodput->ttft_ms : NAN);
        fputs(", \"tpot\": ", f);
        json_num(f, cfg->goodput->tpot_ms >= 0 ? cfg->goodput->tpot_ms : NAN);
        fputs(", \"e2el\": ", f);
        json_num(f, cfg->goodput->e2el_ms >= 0 ? cfg->goodput->e2el_ms : NAN);
        fprintf(f, "}");
        key(f, "good_requests"), fprintf(f, "%d", r->good);
    }
    json_stat(f, "ttft_ms", &r->ttft);
    json_stat(f, "tpot_ms", &r->tpot);
    json_stat(f, "itl_ms", &r->itl);
    json_stat(f, "e2e_ms", &r->e2e);
    fputs(",\n    \"stages\": {", f);
    for (int k = 0; k < BENCH_ST_COUNT; k++) {
        fprintf(f, "%s\"%s_ms\": {\"n\": %d, \"mean\": ", k ? ", " : "", bench_stage_names[k],
                r->stages[k].n);
        json_num(f, r->stages[k].mean);
        fputs(", \"p50\": ", f);
        json_num(f, r->stages[k].p50);
        fputs(", \"p99\": ", f);
        json_num(f, r->stages[k].p99);
        fputc('}', f);
    }
    fputc('}', f);
    fputs(",\n    \"error_summary\": [", f);
    for (int k = 0; k < r->n_error_kinds; k++) {
        fprintf(f, "%s{\"count\": %d, \"message\": ", k ? ", " : "", r->error_counts[k]);
        json_str(f, r->errors[k]);
        fputc('}', f);
    }
    fputs("]\n  }", f);
}

int bench_write_json(const char *path, const bench_result_t *res, int n, int sweep,
                     const bench_report_cfg_t *cfg, bench_rec_t *const *recs, const int *n_recs) {
    FILE *f = fopen(path, "w");
    if (!f) {
        fprintf(stderr, "error: cannot write %s: %s\n", path, strerror(errno));
        return -1;
    }
    if (sweep) fputs("[\n", f);
    for (int i = 0; i < n; i++) {
        if (i) fputs(",\n", f);
        json_result(f, &res[i], cfg, recs ? recs[i] : NULL, n_recs ? n_recs[i] : 0);
    }
    fputs(sweep ? "\n]\n" : "\n", f);
    if (fclose(f) != 0) {
        fprintf(stderr, "error: writing %s: %s\n", path, strerror(errno));
        return -1;
    }
    return 0;
}

/* ---- plots ---- */

/* gnuplot's single-quoted strings: only ' needs doubling. */
static void gp_str(FILE *f, const char *s) {
    fputc('\'', f);
    for (; *s; s++) {
        if (*s == '\'') fputc('\'', f);
        fputc(*s, f);
    }
    fputc('\'', f);
}

/* Opens the gnuplot script gp and writes its head: what it draws, a PNG
 * terminal (cairo when there is one) and the output file png. */
static FILE *open_gp_script(const char *gp, const char *png, const char *what) {
    FILE *f = fopen(gp, "w");
    if (!f) {
        fprintf(stderr, "error: cannot write %s: %s\n", gp, strerror(errno));
        return NULL;
    }
    fprintf(f, "# Draws %s.\n", what);
    fputs("if (strstrt(GPVAL_TERMINALS, 'pngcairo') > 0) {\n"
          "  set terminal pngcairo size 1200,480\n"
          "} else {\n"
          "  set terminal png size 1200,480\n"
          "}\n"
          "set output ",
          f);
    gp_str(f, png);
    return f;
}

static int run_gnuplot(const char *png, const char *dat, char *gp);

/* PNG without ".png", then ".dat" and ".gp" file names. */
static int plot_names(const char *png, char *dat, char *gp, size_t n) {
    char base[1024];
    size_t len = strlen(png);
    if (len >= sizeof base || len + 8 > n) {
        fprintf(stderr, "error: the plot path is too long\n");
        return -1;
    }
    snprintf(base, sizeof base, "%s", png);
    if (len > 4 && !strcmp(base + len - 4, ".png")) base[len - 4] = '\0';
    snprintf(dat, n, "%s.dat", base);
    snprintf(gp, n, "%s.gp", base);
    return 0;
}

/* Writes PNG.dat (per rate: the mean of each server stage; then p50 and
 * p99 per stage of the last rate) and PNG.gp, and draws PNG: where the
 * time of a request goes, stacked, against the offered rate; and the
 * spread of each stage at the last (highest) rate. */
int bench_write_stage_plot(const char *png, const bench_result_t *res, int n, const char *model) {
    char dat[1100], gp[1100];
    if (plot_names(png, dat, gp, sizeof dat) < 0) return -1;
    const bench_result_t *last = NULL;
    for (int i = 0; i < n; i++)
        if (!res[i].skipped && res[i].stages[0].n > 0) last = &res[i];
    if (!last) {
        fprintf(stderr, "warning: the server sent no timings: no stage plot\n");
        return 0;
    }
    FILE *f = fopen(dat, "w");
    if (!f) {
        fprintf(stderr, "error: cannot write %s: %s\n", dat, strerror(errno));
        return -1;
    }
    fprintf(f, "# loom bench stage breakdown, model %s; milliseconds\n# rate", model);
    for (int k = 0; k < BENCH_ST_COUNT; k++)
        fprintf(f, " %s_mean", bench_stage_names[k]);
    fputc('\n', f);
    for (int i = 0; i < n; i++) {
        const bench_result_t *r = &res[i];
        if (r->skipped || r->stages[0].n == 0) continue;
        char rl[32];
        rate_label(r->rate, rl, sizeof rl);
        fprintf(f, "%s", rl);
        for (int k = 0; k < BENCH_ST_COUNT; k++)
            fprintf(f, " %.6g", r->stages[k].mean);
        fputc('\n', f);
    }
    char rl[32];
    rate_label(last->rate, rl, sizeof rl);
    fprintf(f, "\n\n# stage p50 p99 at rate %s\n", rl);
    for (int k = 0; k < BENCH_ST_COUNT; k++)
        fprintf(f, "%s %.6g %.6g\n", bench_stage_names[k], last->stages[k].p50,
                last->stages[k].p99);
    fclose(f);
    f = open_gp_script(gp, png, "the server-side stage breakdown of loom bench requests");
    if (!f) return -1;
    char title[400];
    snprintf(title, sizeof title, "loom bench: where a request's time goes (%s)", model);
    fputs("\nset datafile missing 'nan'\nset multiplot layout 1,2 title ", f);
    gp_str(f, title);
    fputs("\nset grid ytics\nset style data histograms\nset style fill solid 0.8 border -1\nset "
          "boxwidth 0.7\n"
          "set ylabel 'ms'\nset key top left\n"
          "set style histogram rowstacked\nset xlabel 'offered rate (req/s)'\n"
          "set title 'mean per request, stacked (= end to end)'\nplot ",
          f);
    gp_str(f, dat);
    /* columns: 1 rate, 2 tokenize, 3 queue, 4 prefill, 5 decode */
    fputs(" index 0 using 2:xtic(1) title 'tokenize', '' index 0 using 3 title 'queue', "
          "'' index 0 using 4 title 'prefill', '' index 0 using 5 title 'decode'\n"
          "set style histogram clustered gap 1\nset xlabel 'stage'\nset logscale y\nset xtics "
          "rotate by -30\n",
          f);
    snprintf(title, sizeof title, "spread at rate %s req/s", rl);
    fputs("set title ", f);
    gp_str(f, title);
    fputs("\nplot ", f);
    gp_str(f, dat);
    fputs(" index 1 using 2:xtic(1) title 'p50', '' index 1 using 3 title 'p99'\nunset multiplot\n",
          f);
    fclose(f);
    return run_gnuplot(png, dat, gp);
}

/* Writes PNG.dat (the sweep's latencies against the achieved request rate)
 * and PNG.gp (the gnuplot script), then runs gnuplot to draw PNG. */
int bench_write_plot(const char *png, const bench_result_t *res, int n, const char *model) {
    char dat[1100], gp[1100];
    if (plot_names(png, dat, gp, sizeof dat) < 0) return -1;
    FILE *f = fopen(dat, "w");
    if (!f) {
        fprintf(stderr, "error: cannot write %s: %s\n", dat, strerror(errno));
        return -1;
    }
    fprintf(f,
            "# loom bench, model %s; latencies in ms\n"
            "# rate achieved_req_s ttft_p50 ttft_p99 tpot_p50 tpot_p99 e2e_p50 e2e_p99 out_tok_s "
            "failed\n",
            model);
    for (int i = 0; i < n; i++) {
        const bench_result_t *r = &res[i];
        if (r->skipped) continue;
        char rl[32];
        rate_label(r->rate, rl, sizeof rl);
        fprintf(f, "%s %.6g %.6g %.6g %.6g %.6g %.6g %.6g %.6g %d\n", rl, r->req_per_s, r->ttft.p50,
                r->ttft.p99, r->tpot.p50, r->tpot.p99, r->e2e.p50, r->e2e.p99, r->out_tok_per_s,
                r->failed);
    }
    fclose(f);
    f = open_gp_script(gp, png, "loom bench latencies against the achieved request rate");
    if (!f) return -1;
    fputs("\nset datafile missing 'nan'\nset multiplot layout 1,2 title ", f);
    char title[400];
    snprintf(title, sizeof title, "loom bench: %s", model);
    gp_str(f, title);
    fputs("\nset grid\nset key top left\nset xlabel 'achieved request rate (req/s)'\nset ylabel "
          "'ms'\n"
          "set title 'time to first token'\nplot ",
          f);
    gp_str(f, dat);
    fputs(" using 2:3 with linespoints title 'TTFT p50', '' using 2:4 with linespoints title 'TTFT "
          "p99'\n"
          "set title 'time per output token'\nplot ",
          f);
    gp_str(f, dat);
    fputs(" using 2:5 with linespoints title 'TPOT p50', '' using 2:6 with linespoints title 'TPOT "
          "p99'\n"
          "unset multiplot\n",
          f);
    fclose(f);
    return run_gnuplot(png, dat, gp);
}

/* Runs gnuplot on the script gp; a missing or failing gnuplot is a warning
 * (the data and the script stay for later). */
static int run_gnuplot(const char *png, const char *dat, char *gp) {
    char *args[] = {"gnuplot", gp, NULL};
    pid_t pid;
    int e = posix_spawnp(&pid, "gnuplot", NULL, NULL, args, environ);
    if (e != 0) {
        fprintf(stderr,
                "warning: cannot run gnuplot (%s; install gnuplot-nox); the data is in %s and the "
                "script in %s\n",
                strerror(e), dat, gp);
        return 0;
    }
    int ws = 0;
    while (waitpid(pid, &ws, 0) < 0 && errno == EINTR) {
    }
    if (!WIFEXITED(ws) || WEXITSTATUS(ws) != 0) {
        fprintf(stderr, "warning: gnuplot failed on %s; the data is in %s\n", gp, dat);
        return 0;
    }
    fprintf(stderr, "plot: %s (data %s, script %s)\n", png, dat, gp);
    return 0;
}
